//! The cluster-facing side: what the daemon reads from and writes to the API server, with the
//! node's own credentials.
//!
//! - [`kube`]: the watch of the pods bound to this node;
//! - [`confine`]: the unit's confinement to the API server the kubeconfig names;
//! - [`objects`]: the parts of Pods and Nodes the daemon reads;
//! - [`publish`]: the node-state annotation on this node's Node;
//! - [`heartbeat`]: the heartbeat renewed on this node's Node;
//! - [`recovery`]: the ledger against the node's last publication at start, and its rebuild.

pub mod capacity;
pub mod confine;
pub mod heartbeat;
pub mod kube;
pub mod objects;
pub mod publish;
pub mod recovery;
