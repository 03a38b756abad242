//! gpushare-extender: placing pods on GPUs for kube-scheduler.
//!
//! Today this crate holds the offline parts: [`simulate`] runs the core's filter, prioritize
//! and placement over a cluster description and real Pod manifests, the way the extender will
//! decide for kube-scheduler; [`inspect`] renders the cluster table Alibaba's
//! `kubectl inspect gpushare` users know. The HTTP extender itself is built on these.

pub mod inspect;
pub mod simulate;
