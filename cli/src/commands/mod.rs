//! One module per subcommand.

pub mod agent;
pub mod agent_install;
pub mod agent_kubeconfig;
pub mod bench;
mod bench_remote;
pub mod convert;
pub mod crds;
pub mod gateway;
pub mod generate;
mod kube_client;
mod model_args;
pub mod operator;
mod process;
pub mod threads;
pub mod up;
