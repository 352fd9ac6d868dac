//! The build script of the packages whose binaries and tests link the engine
//! (named by `build = "../engine/mlx/rpath.rs"` in their manifests): with the
//! engine's `mlx` feature, embeds two rpaths so they run without
//! LD_LIBRARY_PATH:
//!
//! ```text
//!  $ORIGIN/mlx/lib (@loader_path/mlx/lib on macOS)  a copy next to the binary
//!                                                   (scripts/package.sh lays it out)
//!  <libmlx's directory here>                        the build machine's own
//! ```
//!
//! The first makes a packaged binary work on a machine without this
//! checkout's cache; the second makes the built one work in place. The
//! engine's build script publishes the directory (`links = "shardplane_mlx"`),
//! which reaches packages that depend on the engine directly.

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_SHARDPLANE_MLX_LIBDIR");
    if let Ok(dir) = std::env::var("DEP_SHARDPLANE_MLX_LIBDIR") {
        let origin = if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("macos") {
            "@loader_path"
        } else {
            "$ORIGIN"
        };
        println!("cargo:rustc-link-arg=-Wl,-rpath,{origin}/mlx/lib");
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
