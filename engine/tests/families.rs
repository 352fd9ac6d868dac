//! Model families against their reference implementation: a tiny model of
//! each family with random weights is written by `reference/tiny_model.py`
//! (mlx-lm's model class, in the MLX-community layout and as GGUF the way
//! llama.cpp's converter writes it), with mlx-lm's logits for a prompt and 16
//! greedy steps. Every engine, from every format it reads, whole and split at
//! every kind of layer boundary, with the prompt whole or in slices beside
//! another sequence, must give the same logits (within 1e-4 of the logit
//! range) and the same greedy tokens.
//!
//! ```text
//!  tiny_model.py ──► mlx/ (config.json, model.safetensors) ──► MLX stages
//!                ──► model.gguf ───────────────────────────► candle / MLX stages
//!                ──► reference.json (prompt, tokens, logits) ◄── compared
//! ```

mod common;

use std::ops::Range;
use std::path::Path;

#[cfg(feature = "mlx")]
use common::mlx;
use common::{
    Loader, Reference, TOLERANCE, Tiny, argmax, candle, gap, tiny, tiny_quantized, tiny_with,
};
use shardplane_engine::candle::CandleStage;
use shardplane_engine::pipeline::LocalPipeline;
use shardplane_engine::{LoadOptions, Stage, StageLayout};

/// Runs one sequence per schedule through `p` together: each feeds the
/// prompt in slices of the schedule's sizes (one slice a step), then its own
/// greedy tokens one a step. Every logit row is checked against the
/// reference and every greedy token must be the reference's. Returns the
/// largest gap seen.
fn check(what: &str, p: &mut LocalPipeline, r: &Reference, schedules: &[&[usize]]) -> f32 {
    for s in schedules {
        assert_eq!(
            s.iter().sum::<usize>(),
            r.prompt.len(),
            "{what}: a schedule covers the prompt"
        );
    }
    // Per sequence: prompt slices fed, tokens generated, next input.
    let mut fed = vec![0usize; schedules.len()];
    let mut generated = vec![0usize; schedules.len()];
    let mut next: Vec<Option<u32>> = vec![None; schedules.len()];
    let mut worst = 0.0f32;
    loop {
        let mut batch = Vec::new();
        for (i, schedule) in schedules.iter().enumerate() {
            if generated[i] > r.tokens.len() {
                continue;
            }
            let input = if fed[i] < schedule.len() {
                let start: usize = schedule[..fed[i]].iter().sum();
                r.prompt[start..start + schedule[fed[i]]].to_vec()
            } else {
                vec![next[i].expect("a token after the prompt")]
            };
            batch.push((i as u64 + 1, input));
        }
        if batch.is_empty() {
            break;
        }
        let seqs: Vec<usize> = batch.iter().map(|(s, _)| *s as usize - 1).collect();
        let rows = p.step(batch).unwrap_or_else(|e| panic!("{what}: {e}"));
        for (i, row) in seqs.into_iter().zip(rows) {
            if fed[i] < schedules[i].len() {
                fed[i] += 1;
                if fed[i] < schedules[i].len() {
                    continue; // the prompt is not complete yet: nothing to check
                }
            }
            let k = generated[i];
            let g = gap(&row, &r.logits[k]);
            assert!(
                g < TOLERANCE,
                "{what}: sequence {i} row {k} differs from the reference by {g} of the logit range"
            );
            worst = worst.max(g);
            if k < r.tokens.len() {
                let token = argmax(&row);
                assert_eq!(
                    token, r.tokens[k],
                    "{what}: sequence {i} greedy token {k} (reference margin {})",
                    r.margins[k]
                );
                next[i] = Some(token);
            }
            generated[i] += 1;
        }
    }
    for i in 0..schedules.len() {
        p.release(i as u64 + 1);
    }
    worst
}

/// The split points worth checking for a model of `layers` layers with a
/// global layer every `pattern`: inside a run of sliding layers, just before
/// a global layer, just after it, and three stages around it.
fn sliding_splits(layers: usize, pattern: usize) -> Vec<Vec<Range<usize>>> {
    let global = pattern - 1;
    vec![
        vec![0..layers],
        vec![0..2, 2..layers],
        vec![0..global, global..layers],
        vec![0..global + 1, global + 1..layers],
        vec![0..1, 1..global + 1, global + 1..layers],
    ]
}

/// The schedules: the prompt whole, and in slices beside a sequence that
/// took it whole (prefill and decode mixed in one step, across a window).
fn schedules(prompt: usize) -> [Vec<usize>; 2] {
    [vec![prompt], vec![3, 3, prompt - 6]]
}

/// Every engine and format, every split (`splits` of the model's layer
/// count), both schedules.
fn check_family(family: &str, splits: fn(usize) -> Vec<Vec<Range<usize>>>) {
    check_model(family, &tiny(family), splits);
}

/// Every engine on every format `t` has.
fn check_model(family: &str, t: &Tiny, splits: fn(usize) -> Vec<Vec<Range<usize>>>) {
    let gguf = t.gguf.exists();
    let mut engines = vec![("candle, safetensors", candle(&t.mlx))];
    if gguf {
        engines.push(("candle, GGUF", candle(&t.gguf)));
    }
    #[cfg(feature = "mlx")]
    {
        engines.push(("MLX, safetensors", mlx(&t.mlx)));
        if gguf {
            engines.push(("MLX, GGUF", mlx(&t.gguf)));
        }
    }
    for (engine, load) in &engines {
        check_splits(&format!("{family} on {engine}"), load, t, &splits(t.layers));
    }
    check_held(family, &t.mlx, t.layers);
    if gguf {
        check_held(family, &t.gguf, t.layers);
    }
}

/// What the operator writes of the model at `path` in memory (each
/// engine's figures in the Model's status, `shardplane_models`, from the
/// tensor directory alone) is what each engine holds with its default
/// options, for a first and a last stage (split after the first layer).
fn check_held(what: &str, path: &Path, layers: usize) {
    use shardplane_crds::{Engine, ModelFormat};
    let format = match path.extension().and_then(|e| e.to_str()) {
        Some("gguf") => ModelFormat::Gguf,
        _ => ModelFormat::Safetensors,
    };
    let mut spec = shardplane_testkit::fixtures::model("m").spec;
    spec.format = format;
    let status = shardplane_models::resolve_path(path, format, &spec).unwrap();
    let split = [0..1, 1..layers];
    let counted = |engine: Engine| -> Vec<u64> {
        let held = status
            .engine_footprints
            .iter()
            .find(|e| e.engine == engine)
            .unwrap();
        let sum = |r: &Range<usize>| held.layer_bytes[r.clone()].iter().sum::<u64>();
        vec![
            held.embedding_bytes + sum(&split[0]),
            sum(&split[1]) + held.output_bytes,
        ]
    };
    let layout = |r: &Range<usize>| StageLayout::new(r.clone(), layers).unwrap();
    let options = LoadOptions::default();
    let candle: Vec<u64> = split
        .iter()
        .map(|r| {
            CandleStage::load(path, layout(r), &options)
                .unwrap()
                .weight_bytes() as u64
        })
        .collect();
    assert_eq!(
        candle,
        counted(Engine::Candle),
        "{what} ({format:?}) on candle"
    );
    #[cfg(feature = "mlx")]
    {
        use shardplane_engine::mlx::MlxStage;
        let mlx: Vec<u64> = split
            .iter()
            .map(|r| {
                MlxStage::load(path, layout(r), &options)
                    .unwrap()
                    .weight_bytes() as u64
            })
            .collect();
        assert_eq!(mlx, counted(Engine::Mlx), "{what} ({format:?}) on MLX");
    }
}

/// One engine at each split: every logit row and greedy token as the
/// reference's, with both schedules.
fn check_splits(what: &str, load: &Loader<'_>, t: &Tiny, splits: &[Vec<Range<usize>>]) {
    let r = &t.reference;
    let [whole, sliced] = schedules(r.prompt.len());
    for ranges in splits {
        let what = format!("{what}, stages {ranges:?}");
        let stages = ranges
            .iter()
            .map(|r| load(StageLayout::new(r.clone(), t.layers).unwrap()))
            .collect();
        let mut p = LocalPipeline::from_stages(stages);
        let worst = check(&what, &mut p, r, &[&whole, &sliced]);
        eprintln!("{what}: largest gap {worst:.2e} of the logit range");
    }
}

#[test]
fn gemma3_matches_mlx_lm_on_every_engine_format_and_split() {
    check_family("gemma3_text", |layers| sliding_splits(layers, 6));
}

/// Every boundary of a small model, and three stages.
fn every_boundary(layers: usize) -> Vec<Vec<Range<usize>>> {
    let mut all = vec![vec![0..layers]];
    all.extend((1..layers).map(|b| vec![0..b, b..layers]));
    all.push(vec![0..1, 1..2, 2..layers]);
    all
}

/// Llama 3.1-3.3's RoPE scaling (`llama3`): from config.json's
/// `rope_scaling`, and from the GGUF's `rope_freqs` tensor.
#[test]
fn llama3_rope_scaling_matches_mlx_lm_on_every_engine_format_and_split() {
    check_family("llama3", every_boundary);
}

/// YaRN on a plain family (Qwen 2.5 and 3 for long contexts): from
/// config.json's `rope_scaling`, and from the GGUF's `rope.scaling` keys.
#[test]
fn qwen2_yarn_matches_mlx_lm_on_every_engine_format_and_split() {
    check_family("qwen2_yarn", every_boundary);
}

/// gpt-oss: sliding and global layers in turn, sinks, YaRN, experts with
/// biases; split at every boundary (each between a sliding and a global
/// layer, one way or the other).
#[test]
fn gpt_oss_matches_mlx_lm_on_every_engine_format_and_split() {
    check_family("gpt_oss", every_boundary);
}

/// The whole model, and its first layer apart from the rest.
fn whole_and_first_layer(layers: usize) -> Vec<Vec<Range<usize>>> {
    vec![vec![0..layers], vec![0..1, 1..layers]]
}

/// gpt-oss as MLX-community publishes it quantized: 4-bit experts and
/// attention, the router in 8 bits (groups of 64).
#[test]
fn a_4_bit_gpt_oss_matches_mlx_lm_on_both_engines() {
    check_model(
        "gpt_oss, 4-bit",
        &tiny_quantized("gpt_oss", 4),
        whole_and_first_layer,
    );
}

/// gpt-oss in MXFP4 (4-bit floats sharing a power of two per 32), the
/// mode MLX-community's gpt-oss checkpoints use, with the router in affine
/// 8 bits beside it: both modes in one file. Seed 6: its smallest greedy
/// margin is 0.029 of a logit range near 6 (seed 0 has a near-tie).
#[test]
fn an_mxfp4_gpt_oss_matches_mlx_lm_on_both_engines() {
    let t = tiny_with("gpt_oss", &["6", "mxfp4"]);
    check_model("gpt_oss, MXFP4", &t, whole_and_first_layer);
    // A mode it cannot read is named, not read as another.
    let path = t.mlx.join("config.json");
    let config = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, config.replace("\"mxfp4\"", "\"nvfp4\"")).unwrap();
    let layout = StageLayout::new(0..t.layers, t.layers).unwrap();
    let e = CandleStage::load(&t.mlx, layout, &LoadOptions::default()).unwrap_err();
    assert!(
        e.to_string()
            .contains("\"nvfp4\" (affine and mxfp4 are read)"),
        "{e}"
    );
}

/// gpt-oss from GGUF with its experts in GGUF's MXFP4 blocks (17 bytes per
/// 32 values), as llama.cpp's converter writes it: candle reads them out
/// exactly (and, by default, keeps them as Q8_0, close to them); MLX, whose
/// own GGUF reader lacks the type, reads the file through ours into its
/// `mxfp4` mode, the same codes and scales, and matches at every split
/// (each stage reads only its own layers).
#[test]
fn an_mxfp4_gpt_oss_gguf_runs_on_candle_and_mlx() {
    let t = tiny_with("gpt_oss", &["0", "gguf_mxfp4"]);
    let r = &t.reference;
    let splits = whole_and_first_layer(t.layers);
    check_splits(
        "gpt_oss, MXFP4 GGUF on candle",
        &candle(&t.gguf),
        &t,
        &splits,
    );
    // Kept as Q8_0: close, not exact.
    let layout = StageLayout::new(0..t.layers, t.layers).unwrap();
    let stage = CandleStage::load(&t.gguf, layout, &LoadOptions::default()).unwrap();
    let mut p = LocalPipeline::from_stages(vec![Box::new(stage)]);
    let row = greedy_rows(&mut p, &r.prompt, 1).remove(0);
    let q8 = gap(&row, &r.logits[0]);
    eprintln!("gpt_oss, MXFP4 GGUF as Q8_0 on candle: gap {q8:.2e} of the logit range");
    assert!(q8 < 0.05, "{q8}");
    check_held("gpt_oss, MXFP4 GGUF", &t.gguf, t.layers);
    #[cfg(feature = "mlx")]
    {
        check_splits(
            "gpt_oss, MXFP4 GGUF on MLX",
            &mlx(&t.gguf),
            &t,
            &every_boundary(t.layers),
        );
        // A conversion, which writes MLX's affine config, refuses the blocks
        // by name rather than writing what it cannot describe.
        let out = tempfile::tempdir().unwrap();
        let e = shardplane_engine::mlx::convert::gguf_to_mlx(&t.gguf, out.path()).unwrap_err();
        assert!(e.to_string().contains("MXFP4"), "{e}");
    }
}

/// Qwen3-MoE with a dense second layer: split between routed and dense
/// layers both ways.
#[test]
fn qwen3_moe_matches_mlx_lm_on_every_engine_format_and_split() {
    check_family("qwen3_moe", every_boundary);
}

/// Qwen3-MoE as mlx-lm quantizes it: 4-bit experts and attention in groups
/// of 32, an 8-bit router in groups of 64; MLX multiplies the packed
/// experts as they are (gather_qmm), candle reads them back to f32.
#[test]
fn a_4_bit_qwen3_moe_matches_mlx_lm_on_both_engines() {
    check_model(
        "qwen3_moe, 4-bit",
        &tiny_quantized("qwen3_moe", 4),
        every_boundary,
    );
}

/// Qwen3-MoE in GGUF Q4_0 blocks (stacked experts of 32 × 64 and 64 × 32
/// in one tensor each): the reference holds the values the blocks decode to.
/// candle splits each stacked tensor into one block matrix per expert and,
/// as the tests load it, decodes them (its own Q4_0 kernels round the
/// activations to Q8_0, which moves this tiny model's logits by a few per
/// cent of their range).
#[test]
fn a_q4_0_qwen3_moe_gguf_matches_mlx_lm_on_both_engines() {
    let t = tiny_with("qwen3_moe", &["0", "q4_0"]);
    check_model("qwen3_moe, Q4_0", &t, every_boundary);
}

/// Mixtral in GGUF Q8_0 blocks, Q/K permuted.
#[test]
fn a_q8_0_mixtral_gguf_matches_mlx_lm_on_both_engines() {
    let t = tiny_with("mixtral", &["0", "q8_0"]);
    check_model("mixtral, Q8_0", &t, every_boundary);
}

/// The widths that straddle u32 words: 3 and 6 bits (5 too, by the same code).
#[test]
fn a_3_bit_and_a_6_bit_qwen3_moe_match_mlx_lm_on_both_engines() {
    check_model(
        "qwen3_moe, 3-bit",
        &tiny_quantized("qwen3_moe", 3),
        every_boundary,
    );
    check_model(
        "qwen3_moe, 6-bit",
        &tiny_quantized("qwen3_moe", 6),
        every_boundary,
    );
}

/// Mixtral's experts in 8 bits.
#[test]
fn an_8_bit_mixtral_matches_mlx_lm_on_both_engines() {
    check_model(
        "mixtral, 8-bit",
        &tiny_quantized("mixtral", 8),
        every_boundary,
    );
}

/// Qwen2-MoE as mlx-lm quantizes it: the shared expert's one-row gate too.
#[test]
fn a_4_bit_qwen2_moe_matches_mlx_lm_on_both_engines() {
    check_model(
        "qwen2_moe, 4-bit",
        &tiny_quantized("qwen2_moe", 4),
        every_boundary,
    );
}

/// Qwen2-MoE: Q/K/V biases, weights not renormalised, a shared expert
/// behind a sigmoid gate (a vector in GGUF, a one-row matrix in
/// safetensors).
#[test]
fn qwen2_moe_matches_mlx_lm_on_every_engine_format_and_split() {
    check_family("qwen2_moe", every_boundary);
}

/// DeepSeek V3 (Kimi K2's family) on both engines from both formats, at
/// every boundary (the dense layer against the routed ones): latent
/// attention with its compressed cache, YaRN on interleaved pairs, sigmoid
/// routing within groups with a choice bias, a shared expert.
#[test]
fn deepseek_v3_matches_mlx_lm_on_both_engines_at_every_split() {
    let t = tiny("deepseek_v3");
    check_model("deepseek_v3", &t, every_boundary);
    // Its cache holds one row of latent and rotated key per token and layer.
    let stage = candle(&t.mlx)(StageLayout::new(0..t.layers, t.layers).unwrap());
    assert_eq!(stage.config().kv_bytes_per_token_per_layer(), (64 + 16) * 4);
    // The tests' candle holds it as f32; by default, as f16: half.
    assert_eq!(stage.kv_bytes_per_token_per_layer(), (64 + 16) * 4);
    let half = CandleStage::load(
        &t.mlx,
        StageLayout::new(0..t.layers, t.layers).unwrap(),
        &LoadOptions::default(),
    )
    .unwrap();
    assert_eq!(half.kv_bytes_per_token_per_layer(), (64 + 16) * 2);
}

/// DeepSeek V2 as its Lite model is, on both engines from both formats at
/// every boundary: the query straight from `q_proj`, one `kv_b_proj` per
/// layer (split into the per-head maps when loaded), experts chosen
/// greedily by softmax scores, not renormalised, the routed sum scaled.
#[test]
fn deepseek_v2_matches_mlx_lm_on_both_engines_at_every_split() {
    check_family("deepseek_v2", every_boundary);
}

/// DeepSeek V2's group-limited routing (a group scored by its best expert;
/// each token's experts from its best group of four) on both engines from
/// both formats: in GGUF, softmax gating with groups is V2's.
#[test]
fn deepseek_v2_group_limited_routing_matches_mlx_lm_on_both_engines() {
    check_family("deepseek_v2_groups", whole_and_first_layer);
}

/// DeepSeek V3 as checkpoints converted by older mlx-lm hold it: the per-head
/// maps joined in one `kv_b_proj`, split when loaded.
#[test]
fn a_deepseek_v3_with_a_joined_kv_b_proj_matches_mlx_lm_on_both_engines() {
    check_model(
        "deepseek_v3 with kv_b_proj",
        &tiny("deepseek_v3_kv_b"),
        whole_and_first_layer,
    );
}

/// DeepSeek V3 as mlx-lm quantizes it (4 bits, groups of 32): the per-head
/// latent maps are quantized stacks too.
#[test]
fn a_4_bit_deepseek_v3_matches_mlx_lm_on_both_engines() {
    check_model(
        "deepseek_v3, 4-bit",
        &tiny_quantized("deepseek_v3", 4),
        whole_and_first_layer,
    );
}

/// Mixtral: GGUF names it llama (Q/K permuted for interleaved RoPE), the
/// experts' weights a softmax over the chosen two.
#[test]
fn mixtral_matches_mlx_lm_on_every_engine_format_and_split() {
    check_family("mixtral", every_boundary);
}

/// Activations are plain rows, so a pipeline may mix engines and formats:
/// MLX on safetensors for the sliding layers, candle on GGUF from the global
/// layer on.
#[cfg(feature = "mlx")]
#[test]
fn a_gemma3_pipeline_of_mlx_then_candle_matches_mlx_lm() {
    let t = tiny("gemma3_text");
    let first = mlx(&t.mlx)(StageLayout::new(0..5, t.layers).unwrap());
    let last = candle(&t.gguf)(StageLayout::new(5..t.layers, t.layers).unwrap());
    let mut p = LocalPipeline::from_stages(vec![first, last]);
    let [whole, sliced] = schedules(t.reference.prompt.len());
    check("MLX then candle", &mut p, &t.reference, &[&whole, &sliced]);
}

/// What llama.cpp made of a family's tiny GGUF: its greedy tokens and the
/// five most likely tokens' log-probabilities at each step (recorded by
/// `reference/llama_cpp.py` into `fixtures/llama-cpp/`), with mlx-lm's
/// tokens on the weights it was recorded on.
#[derive(serde::Deserialize)]
struct LlamaCpp {
    tokens: Vec<u32>,
    /// `None` where llama-server withheld them (a byte token ending inside
    /// a UTF-8 character).
    top: Vec<Option<Vec<(u32, f32)>>>,
    reference: Vec<u32>,
}

/// The logit rows of a greedy run: the prompt, then each chosen token.
fn greedy_rows(p: &mut LocalPipeline, prompt: &[u32], steps: usize) -> Vec<Vec<f32>> {
    let mut rows = vec![p.step(vec![(1, prompt.to_vec())]).unwrap().remove(0)];
    for _ in 1..steps {
        let next = argmax(rows.last().unwrap());
        rows.push(p.step(vec![(1, vec![next])]).unwrap().remove(0));
    }
    p.release(1);
    rows
}

fn log_softmax(row: &[f32]) -> Vec<f32> {
    let max = row.iter().cloned().fold(f32::MIN, f32::max);
    let sum: f64 = row.iter().map(|&x| f64::from(x - max).exp()).sum();
    row.iter()
        .map(|&x| (f64::from(x - max) - sum.ln()) as f32)
        .collect()
}

/// Both engines on the family's GGUF give llama.cpp's greedy tokens, and
/// log-probabilities within 1e-4 of its top five at every step it reported
/// them (2e-3 for Gemma: llama.cpp's CPU GELU reads a float16 table).
fn check_against_llama_cpp(family: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/llama-cpp")
        .join(format!("{family}.json"));
    let fixture: LlamaCpp = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let t = tiny(family);
    assert_eq!(
        t.reference.tokens, fixture.reference,
        "{family}: the tiny model is not the one the llama.cpp fixture was recorded on \
         (run reference/llama_cpp.py again)"
    );
    assert_eq!(
        fixture.tokens, t.reference.tokens,
        "{family}: llama.cpp vs mlx-lm"
    );
    #[cfg_attr(not(feature = "mlx"), allow(unused_mut))]
    let mut engines = vec![("candle", candle(&t.gguf))];
    #[cfg(feature = "mlx")]
    engines.push(("MLX", mlx(&t.gguf)));
    for (engine, load) in &engines {
        let whole = load(StageLayout::new(0..t.layers, t.layers).unwrap());
        let mut p = LocalPipeline::from_stages(vec![whole]);
        let rows = greedy_rows(&mut p, &t.reference.prompt, fixture.tokens.len());
        let mut worst = 0.0f32;
        // llama.cpp's CPU GELU reads a float16 table (Gemma's feed-forward).
        let tolerance = if family.starts_with("gemma") {
            2e-3
        } else {
            1e-4
        };
        let checked = fixture.top.iter().flatten().count();
        assert!(
            checked >= fixture.top.len() / 2,
            "{family}: {checked} steps with log-probabilities"
        );
        for (k, (row, top)) in rows.iter().zip(&fixture.top).enumerate() {
            assert_eq!(
                argmax(row),
                fixture.tokens[k],
                "{family} on {engine}: token {k}"
            );
            let ours = log_softmax(row);
            for &(id, logprob) in top.iter().flatten() {
                let gap = (ours[id as usize] - logprob).abs();
                worst = worst.max(gap);
                assert!(
                    gap < tolerance,
                    "{family} on {engine}: step {k} token {id}: {} vs llama.cpp's {logprob}",
                    ours[id as usize]
                );
            }
        }
        eprintln!(
            "{family} on {engine}, GGUF: largest log-probability gap to llama.cpp {worst:.1e}"
        );
    }
}

#[test]
fn the_tiny_ggufs_run_as_llama_cpp_runs_them() {
    for family in [
        "gemma3_text",
        "qwen3_moe_routed",
        "qwen2_moe",
        "mixtral",
        "llama3",
        "qwen2_yarn",
        "gpt_oss",
        "deepseek_v3",
        "deepseek_v2_lite",
    ] {
        check_against_llama_cpp(family);
    }
}

/// gpt-oss answers in the harmony format. Its tiny model has the harmony
/// markup as special tokens, the tests' harmony template and `<|return|>`
/// and `<|call|>` as stops (from generation_config.json). Under the grammar
/// of its tools, or of a JSON answer, its random weights still write
/// harmony: reasoning (or none, with reasoning off), then a call or a final
/// message. The reader gives back the call and the answer with the markup
/// gone, as a head stage gives them to the gateway.
#[test]
fn gpt_oss_calls_tools_and_answers_json_in_the_harmony_format() {
    use shardplane_engine::answer::{AnswerReader, Ending, Split};
    use shardplane_engine::chat::{ChatMessage, ChatOptions};
    use shardplane_engine::constraint::Grammar;
    use shardplane_engine::generation::ValidRequest;
    use shardplane_engine::pipeline::{FinishReason, Generation, TextModel, generate_request};
    use shardplane_engine::sampler::SamplingParams;
    use shardplane_engine::tools::{Tool, ToolChoice, ToolSet};
    let t = tiny("gpt_oss");
    let text = TextModel::from_dir(&t.mlx).unwrap();
    assert!(text.harmony());
    for stop in ["<|return|>", "<|call|>", "<|endoftext|>"] {
        let id = text.tokenizer.token_id(stop).unwrap();
        assert!(text.tokenizer.stop_tokens().contains(&id), "{stop}");
    }
    // The harmony prompt is longer than the tiny model's 128 positions.
    let options = LoadOptions {
        dequantize: true,
        context_length: Some(4096),
        ..Default::default()
    };
    let layout = StageLayout::new(0..t.layers, t.layers).unwrap();
    let stage = CandleStage::load(&t.mlx, layout, &options).unwrap();
    let mut p = LocalPipeline::from_stages(vec![Box::new(stage)]);
    let weather = ToolSet {
        tools: vec![Tool {
            name: "get_weather".into(),
            description: "The weather in a city.".into(),
            parameters: serde_json::json!({"type": "object", "additionalProperties": false,
                "required": ["city"],
                "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12}}}),
        }],
        choice: ToolChoice::Required,
        parallel: false,
    };
    let messages = [ChatMessage::new("user", "What is the weather in Paris?")];
    let mut run = |thinking: Option<bool>,
                   tools: Option<&ToolSet>,
                   answer: Option<Grammar>,
                   seed: u64|
     -> (Generation, Split, Ending) {
        let options = ChatOptions::new(Default::default(), thinking).unwrap();
        let prompt = text
            .conversation_prompt(&messages, tools, &options)
            .unwrap();
        let grammar = text
            .answer_grammar(answer, tools, Some(&options))
            .unwrap()
            .unwrap();
        let params = SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            max_tokens: 3000,
            ..Default::default()
        };
        let request = ValidRequest::new(prompt.clone(), Vec::new(), params, 256, 4096)
            .unwrap()
            .with_constraint(text.constraint(&grammar).unwrap())
            .unwrap();
        let g = generate_request(&mut p, &text, seed, &request, |_| {}).unwrap();
        let mut reader = AnswerReader::new(&text, &prompt, true, tools.is_some());
        let split = reader.push(&g.text).unwrap();
        let ending = reader.finish(g.finish == FinishReason::Stop).unwrap();
        (g, split, ending)
    };
    for (thinking, seed) in [(Some(false), 1), (None, 2)] {
        let (g, split, ending) = run(thinking, Some(&weather), None, seed);
        let what = format!("thinking {thinking:?}: {:?}", g.text);
        assert_eq!(g.finish, FinishReason::Stop, "{what}");
        let calls = [split.tool_calls, ending.split.tool_calls].concat();
        assert!(ending.called && !ending.cut && calls.len() == 1, "{what}");
        assert_eq!(calls[0].name, "get_weather", "{what}");
        let args: serde_json::Value = serde_json::from_str(&calls[0].arguments).unwrap();
        let city = args["city"].as_str().unwrap();
        assert!(
            (1..=12).contains(&city.chars().count()) && args.as_object().unwrap().len() == 1,
            "{what}"
        );
        assert!(
            !split.text.contains("<|") && !split.reasoning.contains("<|"),
            "{what}"
        );
        if thinking == Some(false) {
            // The grammar holds it to its answer: no analysis at all.
            assert!(
                !g.text.contains("analysis") && split.reasoning.is_empty(),
                "{what}"
            );
        }
    }
    // Reasoning off: the prompt holds an empty analysis message.
    let off = ChatOptions::new(Default::default(), Some(false)).unwrap();
    let prompt = text.conversation_prompt(&messages, None, &off).unwrap();
    let prompt = text.tokenizer.decode(&prompt, false).unwrap();
    assert!(
        prompt
            .ends_with("<|start|>assistant<|channel|>analysis<|message|><|end|><|start|>assistant"),
        "{prompt}"
    );
    // A JSON answer: the final message is the JSON, the reasoning apart.
    let schema = serde_json::json!({"type": "object", "additionalProperties": false,
        "required": ["ok"], "properties": {"ok": {"type": "boolean"}}});
    let (g, split, ending) = run(None, None, Some(Grammar::JsonSchema(schema)), 3);
    let answer = split.text + &ending.split.text;
    let value: serde_json::Value = serde_json::from_str(&answer)
        .unwrap_or_else(|e| panic!("{e}: {answer:?} from {:?}", g.text));
    assert!(value["ok"].is_boolean(), "{answer}");
    assert!(
        !ending.called && g.finish == FinishReason::Stop,
        "{:?}",
        g.text
    );
}
