//! One module per subcommand.

pub mod bench;
pub mod crds;
pub mod generate;
mod model_args;
