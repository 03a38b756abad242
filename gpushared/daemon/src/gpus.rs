//! The node's GPUs: what they are, whether they are healthy, how they are shared and what their
//! processes use.
//!
//! - [`discovery`]: the host's GPUs, from NVML or the configuration;
//! - [`events`]: Xid and ECC events and GPU probes, from NVML;
//! - [`health`]: the GPU health policy, automatic recovery included;
//! - [`monitor`]: starting the health and over-use threads;
//! - [`mps`]: the environment file the MPS control daemon's unit reads;
//! - [`overuse`]: GPU processes against the containers' budgets, with warn or evict.

pub mod discovery;
pub mod events;
pub mod health;
pub mod monitor;
pub mod mps;
pub mod overuse;
