//! The `shardplane` binary with the MLX engine: `convert`, `generate --engine
//! mlx` on a GGUF file split into stages and on the converted directory, and
//! `bench --engine mlx`. The binary runs without LD_LIBRARY_PATH (rpath).
#![cfg(feature = "mlx")]

use std::process::{Command, Output};

fn shardplane(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_shardplane"))
        .args(args)
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("SHARDPLANE_MODEL")
        .output()
        .expect("the binary runs")
}

fn ok(out: Output) -> (String, String) {
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    (stdout, stderr)
}

#[test]
fn convert_then_generate_with_mlx_from_gguf_stages_and_from_the_directory() {
    let gguf = shardplane_testkit::test_model();
    let gguf = gguf.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("smollm2-mlx");
    let out_s = out.to_str().unwrap();

    let (stdout, _) = ok(shardplane(&["convert", "--model", gguf, "--out", out_s]));
    assert!(stdout.contains("694 tensors"), "{stdout}");
    assert!(
        stdout.contains("210 × 4-bit/32") && stdout.contains("1 × 8-bit/32"),
        "{stdout}"
    );
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(out.join(f).is_file(), "{f} missing");
    }
    // A second conversion into the same directory needs --force.
    let again = shardplane(&["convert", "--model", gguf, "--out", out_s]);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("--force"));

    let generate_with = |engine: &str, model: &str, extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--engine",
            engine,
            "--model",
            model,
            "--chat",
            "--prompt",
            "Name three colors.",
            "--max-tokens",
            "8",
            "--print-tokens",
        ];
        args.extend_from_slice(extra);
        let (text, stderr) = ok(shardplane(&args));
        (text, shardplane_testkit::tokens_line(&stderr))
    };
    let generate = |model: &str, extra: &[&str]| generate_with("mlx", model, extra);
    let (text, split) = generate(gguf, &["--stages", "0-14,15-29"]);
    assert!(!text.trim().is_empty());
    let (from_dir, dir_tokens) = generate(out_s, &["--stages", "0-9,10-29"]);
    assert_eq!(dir_tokens, split);
    assert_eq!(from_dir, text);

    // candle reads the directory too: MLX's 4-bit groups are the GGUF's
    // Q4_1 blocks, read back and quantized to Q8_0 as candle does with Q4_1,
    // so it gives candle's tokens on the GGUF.
    let (candle_text, candle_tokens) = generate_with("candle", gguf, &[]);
    let (candle_dir_text, candle_dir_tokens) =
        generate_with("candle", out_s, &["--stages", "0-9,10-29"]);
    assert_eq!(candle_dir_tokens, candle_tokens);
    assert_eq!(candle_dir_text, candle_text);
    let unknown = shardplane(&[
        "generate", "--engine", "tpu", "--model", gguf, "--prompt", "hi",
    ]);
    let e = String::from_utf8_lossy(&unknown.stderr);
    assert!(e.contains("available are candle, mlx"), "{e}");
}

#[test]
fn bench_takes_the_mlx_engine() {
    let gguf = shardplane_testkit::test_model();
    let (stdout, _) = ok(shardplane(&[
        "bench",
        "--engine",
        "mlx",
        "--model",
        gguf.to_str().unwrap(),
        "--stages",
        "0-14,15-29",
        "--prompt-tokens",
        "16",
        "--gen-tokens",
        "4",
        "--runs",
        "1",
        "--temperature",
        "0.75",
        "--top-p",
        "0.5",
        "--json",
    ]));
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("a JSON report");
    assert_eq!(report["engine"], "mlx");
    assert_eq!(report["temperature"], 0.75, "the sampling is recorded");
    assert_eq!(report["top_p"], 0.5, "{report}");
    assert_eq!(
        report["stages"].as_array().map(Vec::len),
        Some(2),
        "{report}"
    );
    let decode = report["decode_tokens_per_second"]["median"]
        .as_f64()
        .unwrap();
    assert!(decode > 0.0, "{report}");
}
