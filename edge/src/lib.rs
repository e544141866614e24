//! The edge. For now: the client of the control plane's edge slice API, with which an
//! edge registers, follows its slice of the log (resuming after disconnects) and
//! reports what it observes. Sandbox runtimes and reconciliation build on it.

mod agent_http;
pub mod cgroups;
pub mod container;
pub mod desired;
pub mod identity;
pub mod images;
mod kmsg;
pub mod metrics_history;
pub mod microvms;
pub mod net;
pub mod node;
mod ns;
pub mod proxy;
pub mod reconcile;
pub mod slice;
mod status_pipe;
pub mod testing;
pub mod transfer;
pub mod vm;
