//! With the `mlx` feature: compiles the C++ shim over libmlx (`mlx/shim.cpp`)
//! and links libmlx, embedding its directory as an rpath. Without it: nothing.
//!
//! MLX is found at `$SHARDPLANE_MLX_DIR` (a directory holding
//! `include/mlx/mlx.h` and `lib/libmlx.so` or `lib/libmlx.dylib`: the `mlx/`
//! directory of the `mlx-cpu` or `mlx-metal` wheel, or Homebrew's prefix), else
//! at `~/.cache/shardplane/mlx/<VERSION>/mlx`, where `scripts/mlx.sh` installs
//! the pinned wheel.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=mlx/shim.cpp");
    println!("cargo:rerun-if-changed=mlx/VERSION");
    println!("cargo:rerun-if-env-changed=SHARDPLANE_MLX_DIR");
    println!("cargo:rerun-if-env-changed=SHARDPLANE_CACHE");
    #[cfg(feature = "mlx")]
    mlx::build();
}

#[cfg(feature = "mlx")]
mod mlx {
    use std::path::{Path, PathBuf};

    fn find() -> Result<PathBuf, String> {
        let version = std::fs::read_to_string("mlx/VERSION").map_err(|e| e.to_string())?;
        let version = version.trim();
        let valid = |dir: &Path| dir.join("include/mlx/mlx.h").is_file();
        if let Some(dir) = std::env::var_os("SHARDPLANE_MLX_DIR") {
            let dir = PathBuf::from(dir);
            return if valid(&dir) {
                Ok(dir)
            } else {
                Err(format!(
                    "SHARDPLANE_MLX_DIR={} holds no include/mlx/mlx.h",
                    dir.display()
                ))
            };
        }
        let cache = std::env::var_os("SHARDPLANE_CACHE")
            .map(PathBuf::from)
            .or_else(|| {
                std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/shardplane"))
            })
            .ok_or("neither SHARDPLANE_CACHE nor HOME is set")?;
        let pinned = cache.join("mlx").join(version).join("mlx");
        if valid(&pinned) {
            return Ok(pinned);
        }
        // Homebrew's mlx on Apple Silicon (untested).
        let brew = PathBuf::from("/opt/homebrew");
        if cfg!(target_os = "macos") && valid(&brew) {
            return Ok(brew);
        }
        Err(format!(
            "MLX {version} is not installed at {}",
            pinned.display()
        ))
    }

    pub fn build() {
        let dir = match find() {
            Ok(dir) => dir,
            Err(why) => panic!(
                "\n\nthe `mlx` feature needs libmlx: {why}.\n\
                 Install the pinned wheel with `bash scripts/mlx.sh` (Linux: mlx-cpu from PyPI, \
                 plus Debian's libopenblas0), or point SHARDPLANE_MLX_DIR at a directory with \
                 include/mlx/mlx.h and lib/libmlx.* (macOS: the mlx-metal wheel's mlx/ directory, \
                 or Homebrew's prefix after `brew install mlx`).\n\n"
            ),
        };
        let linux = std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux");
        let mut build = cc::Build::new();
        build
            .cpp(true)
            .std("c++20")
            .file("mlx/shim.cpp")
            .include(dir.join("include"))
            .flag_if_supported("-Wno-unused-parameter");
        if linux {
            build.define("SHARDPLANE_OPENBLAS", None);
        }
        build.compile("shardplane_mlx_shim");
        let lib = dir.join("lib");
        println!("cargo:rustc-link-search=native={}", lib.display());
        if linux {
            // OpenBLAS ahead of libmlx: its cblas_sgemm wins over the slow
            // reference BLAS the wheel bundles (the shim calls OpenBLAS, so
            // the library stays a dependency of every binary).
            println!("cargo:rustc-link-lib=dylib:+verbatim=libopenblas.so.0");
        }
        println!("cargo:rustc-link-lib=dylib=mlx");
        // This package's own tests find libmlx through the rpath; packages
        // that depend on it read DEP_SHARDPLANE_MLX_LIBDIR in their build scripts.
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
        println!("cargo:libdir={}", lib.display());
    }
}
