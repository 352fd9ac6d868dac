//! The build script of the packages whose binaries and tests link the engine
//! (named by `build = "../engine/mlx/rpath.rs"` in their manifests): with the
//! engine's `mlx` feature, embeds libmlx's directory as an rpath so they run
//! without LD_LIBRARY_PATH. The engine's build script publishes the directory
//! (`links = "shardplane_mlx"`), which reaches packages that depend on the
//! engine directly.

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_SHARDPLANE_MLX_LIBDIR");
    if let Ok(dir) = std::env::var("DEP_SHARDPLANE_MLX_LIBDIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
