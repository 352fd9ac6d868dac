//! Tensor groups against the whole model, on the real test model
//! (SmolLM2-135M-Instruct: 9 query heads in 3 KV groups, 1536 MLP columns):
//! two and three ranks, an uneven 2:1 split, a pipeline of two tensor
//! groups; the ranks joined over loopback TCP by the data plane's
//! all-reduce; and mixture-of-experts layers on tiny models of three
//! families. And a group whose rank fails stops, saying so.
//!
//! With exact (f32) weights a split changes only the order of the sums:
//! logits agree within 1e-4 of the row's scale. With quantized weights
//! candle rounds every product's input to 8 bits, which turns those last
//! bits into logit differences of a few percent — about as large as the
//! quantized model's own distance from its exact weights, which bounds them.

use std::path::Path;
use std::time::Duration;

use shardplane_dataplane::Token;
use shardplane_dataplane::collective::Mesh;
use shardplane_engine::candle::CandleStage;
use shardplane_engine::chat::ChatMessage;
use shardplane_engine::gguf::GgufFile;
use shardplane_engine::pipeline::{LocalPipeline, TextModel};
use shardplane_engine::tensor::{AllReduce, TensorSplit};
use shardplane_engine::{Error, KvPrecision, LoadOptions, Stage, StageInput, StageLayout};

const LAYERS: usize = 30;
const STEPS: usize = 24;
/// One stage of every layer.
#[allow(clippy::single_range_in_vec_init)]
const WHOLE: &[std::ops::Range<usize>] = &[0..LAYERS];

/// Ranks joined over loopback, as engine collectives.
fn collectives(ranks: usize) -> Vec<Box<dyn AllReduce>> {
    let token = Token::random().unwrap();
    Mesh::loopback(ranks, &token, Duration::from_secs(30))
        .unwrap()
        .into_iter()
        .map(|mut m| {
            Box::new(move |v: &mut [f32]| m.all_reduce(v).map_err(|e| e.to_string()))
                as Box<dyn AllReduce>
        })
        .collect()
}

/// Stages `ranges` of the model, each a tensor group with rank `weights`.
fn grouped(
    path: &Path,
    ranges: &[std::ops::Range<usize>],
    weights: &[f64],
    options: &LoadOptions,
) -> LocalPipeline {
    let config = GgufFile::open(path).unwrap().config().clone();
    let split = TensorSplit::weighted(&config, weights).unwrap();
    let stages = ranges
        .iter()
        .map(|r| {
            let layout = StageLayout::new(r.clone(), config.layers).unwrap();
            let ranks = collectives(weights.len());
            let group = CandleStage::load_group(path, layout, options, &split, ranks).unwrap();
            Box::new(group) as Box<dyn Stage>
        })
        .collect();
    LocalPipeline::from_stages(stages)
}

fn whole(path: &Path, options: &LoadOptions) -> LocalPipeline {
    let layers = GgufFile::open(path).unwrap().config().layers;
    let stage = CandleStage::load(path, StageLayout::whole(layers), options).unwrap();
    LocalPipeline::from_stages(vec![Box::new(stage)])
}

/// f32 products and an f32 KV cache: a split sums in another order, and
/// an f16 cache would turn a last-bit difference of a key into a rounding
/// step of its own.
fn exact() -> LoadOptions {
    LoadOptions {
        dequantize: true,
        kv_precision: KvPrecision::F32,
        ..Default::default()
    }
}

fn prompts(path: &Path) -> Vec<Vec<u32>> {
    let text = TextModel::from_gguf(&GgufFile::open(path).unwrap()).unwrap();
    let chat = |q: &str| text.chat_prompt(&[ChatMessage::new("user", q)]).unwrap();
    vec![
        chat("Why is the sky blue?"),
        text.raw_prompt("The capital of France is").unwrap(),
        chat("Write a haiku about the sea."),
    ]
}

/// The top token and its margin over the second.
fn top(row: &[f32]) -> (usize, f32) {
    let mut sorted: Vec<(usize, f32)> = row.iter().copied().enumerate().collect();
    sorted.sort_by(|a, b| b.1.total_cmp(&a.1));
    (sorted[0].0, sorted[0].1 - sorted[1].1)
}

/// Runs both pipelines greedily for `STEPS` tokens on every prompt (the
/// other fed the reference's tokens, so one near-tie cannot derail the
/// rest); returns the largest logit difference relative to the row's
/// largest magnitude, and the steps whose greedy tokens differ although
/// the reference's top two are further apart than `tie`.
fn compare(
    reference: &mut LocalPipeline,
    other: &mut LocalPipeline,
    prompts: &[Vec<u32>],
    tie: f32,
) -> (f32, Vec<String>) {
    let mut worst = 0f32;
    let mut differ = Vec::new();
    for (i, prompt) in prompts.iter().enumerate() {
        let seq = i as u64 + 1;
        let mut input = prompt.clone();
        for step in 0..STEPS {
            let want = reference
                .step(vec![(seq, input.clone())])
                .unwrap()
                .remove(0);
            let got = other.step(vec![(seq, input)]).unwrap().remove(0);
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            let gap = want
                .iter()
                .zip(&got)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            worst = worst.max(gap / scale);
            let (token, margin) = top(&want);
            if margin > tie && top(&got).0 != token {
                differ.push(format!("prompt {seq}, step {step}"));
            }
            input = vec![token as u32];
        }
        reference.release(seq);
        other.release(seq);
    }
    (worst, differ)
}

fn check_exact(
    what: &str,
    reference: &mut LocalPipeline,
    split: &mut LocalPipeline,
    prompts: &[Vec<u32>],
) {
    let (worst, differ) = compare(reference, split, prompts, 1e-3);
    eprintln!("{what}: largest logit difference {worst:.2e} of the row's scale");
    assert!(
        worst <= 1e-4,
        "{what}: logits differ by {worst:.2e} of the row's scale"
    );
    assert!(
        differ.is_empty(),
        "{what}: greedy tokens differ at {differ:?}"
    );
}

#[test]
fn two_and_three_ranks_and_an_uneven_split_match_the_whole_model() {
    let path = shardplane_testkit::test_model();
    let prompts = prompts(&path);
    let mut reference = whole(&path, &exact());
    for (what, weights) in [
        ("tensor 2", vec![1.0, 1.0]),
        ("tensor 3", vec![1.0, 1.0, 1.0]),
        ("tensor 2:1", vec![2.0, 1.0]),
    ] {
        let mut split = grouped(&path, WHOLE, &weights, &exact());
        check_exact(what, &mut reference, &mut split, &prompts);
    }
}

#[test]
fn a_pipeline_of_two_tensor_groups_matches_the_whole_model() {
    let path = shardplane_testkit::test_model();
    let mut reference = whole(&path, &exact());
    let mut split = grouped(&path, &[0..13, 13..LAYERS], &[1.0, 1.0], &exact());
    check_exact(
        "pipeline 2 × tensor 2",
        &mut reference,
        &mut split,
        &prompts(&path),
    );
}

#[test]
fn quantized_splits_stay_within_the_quantization_noise() {
    let path = shardplane_testkit::test_model();
    let prompts = &prompts(&path)[..2];
    for (what, options, ranks) in [
        ("Q8_0 (re-quantized), tensor 3", LoadOptions::default(), 3),
        (
            "Q4_1, tensor 2",
            LoadOptions {
                requantize_slow_types: false,
                ..Default::default()
            },
            2,
        ),
    ] {
        let mut quantized = whole(&path, &options);
        let mut exact_whole = whole(&path, &exact());
        let (noise, _) = compare(&mut exact_whole, &mut quantized, prompts, f32::INFINITY);
        let mut split = grouped(&path, WHOLE, &vec![1.0; ranks], &options);
        let (gap, _) = compare(&mut quantized, &mut split, prompts, f32::INFINITY);
        eprintln!("{what}: split vs whole {gap:.2e}, quantized vs exact {noise:.2e}");
        // A wrong share would be off by the logits' own size.
        assert!(
            gap <= 1.5 * noise,
            "{what}: the split is {gap:.2e} from the whole model, far more than the \
             quantization's own {noise:.2e}"
        );
    }
}

/// Mixture-of-experts layers split across ranks: each rank holds every
/// expert's share of its columns and routes every token itself. Tiny
/// models of four families (written by `reference/tiny_model.py`, f32
/// GGUF): Qwen3-MoE with a dense layer among the routed ones, Qwen2-MoE
/// with its gated shared expert, gpt-oss with biases on the router and
/// every expert (the down projection's added by one rank), attention sinks
/// and sliding layers, and DeepSeek V3, whose ranks take whole heads of its
/// latent attention (each computing and caching the shared latent) and
/// route within groups. Two ranks, even and 2:1.
#[test]
fn mixture_of_experts_layers_split_like_dense_ones() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/tiny_model.py");
    for family in ["qwen3_moe", "qwen2_moe", "gpt_oss", "deepseek_v3"] {
        let dir = tempfile::tempdir().unwrap();
        shardplane_testkit::run_reference(&script, &[dir.path().as_os_str(), family.as_ref()]);
        let path = dir.path().join("model.gguf");
        let layers = GgufFile::open(&path).unwrap().config().layers;
        let prompts = vec![
            vec![2, 17, 201, 5, 99, 64, 130, 7, 250, 33, 12],
            (40..80).collect(),
        ];
        let mut reference = whole(&path, &exact());
        for (what, weights) in [("tensor 2", vec![1.0, 1.0]), ("tensor 2:1", vec![2.0, 1.0])] {
            let whole_range = 0..layers;
            let mut split = grouped(
                &path,
                std::slice::from_ref(&whole_range),
                &weights,
                &exact(),
            );
            let what = format!("{family}, {what}");
            check_exact(&what, &mut reference, &mut split, &prompts);
        }
    }
}

#[test]
fn a_group_whose_rank_fails_is_unavailable_from_then_on() {
    let path = shardplane_testkit::test_model();
    let config = GgufFile::open(&path).unwrap().config().clone();
    let split = TensorSplit::even(&config, 2).unwrap();
    let mut meshes = Mesh::loopback(2, &Token::random().unwrap(), Duration::from_secs(30)).unwrap();
    let mut second = Some(meshes.pop().unwrap());
    let mut first = meshes.pop().unwrap();
    let mut calls = 0;
    let collectives: Vec<Box<dyn AllReduce>> = vec![
        Box::new(move |v: &mut [f32]| first.all_reduce(v).map_err(|e| e.to_string())),
        // Rank 1 goes away in the middle of the second step's layers: its
        // connections close, and rank 0 hears of it at its next sum.
        Box::new(move |v: &mut [f32]| {
            calls += 1;
            if calls > LAYERS * 2 + 7 {
                second = None;
            }
            match &mut second {
                Some(m) => m.all_reduce(v).map_err(|e| e.to_string()),
                None => Err("this rank stopped".into()),
            }
        }),
    ];
    let layout = StageLayout::whole(LAYERS);
    let mut group =
        CandleStage::load_group(&path, layout, &LoadOptions::default(), &split, collectives)
            .unwrap();
    group.forward(1, StageInput::Tokens(vec![1, 2, 3])).unwrap();
    let e = group.forward(1, StageInput::Tokens(vec![4])).unwrap_err();
    assert!(matches!(e, Error::Unavailable(_)), "{e}");
    assert!(e.to_string().contains("rank 1: "), "{e}");
    let e = group.forward(2, StageInput::Tokens(vec![4])).unwrap_err();
    assert!(e.to_string().contains("tensor group broken"), "{e}");
}

#[test]
fn bad_input_is_refused_without_breaking_the_group() {
    let path = shardplane_testkit::test_model();
    let config = GgufFile::open(&path).unwrap().config().clone();
    let split = TensorSplit::even(&config, 3).unwrap();
    let layout = StageLayout::whole(LAYERS);
    let options = LoadOptions::default();
    let mut group =
        CandleStage::load_group(&path, layout, &options, &split, collectives(3)).unwrap();
    let e = group
        .forward(1, StageInput::Tokens(vec![u32::MAX]))
        .unwrap_err();
    assert!(e.is_callers(), "{e}");
    group.forward(1, StageInput::Tokens(vec![1, 2])).unwrap();
    assert_eq!(group.sequence_len(1), 2);
    assert!(group.release(1));
    assert_eq!(group.sequences(), 0);
}

#[test]
fn splits_the_model_cannot_take_say_why() {
    let path = shardplane_testkit::test_model();
    let config = GgufFile::open(&path).unwrap().config().clone();
    let e = TensorSplit::even(&config, 4).unwrap_err();
    assert!(
        e.to_string().contains("4 ranks need at least 4 KV heads"),
        "{e}"
    );
}
