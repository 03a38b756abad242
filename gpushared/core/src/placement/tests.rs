//! Placement tests.
