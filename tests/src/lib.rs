//! The cluster in a box: stand-ins that speak the real protocols, for tests and the demo.
