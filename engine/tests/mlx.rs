//! The MLX backend on the real test model (SmolLM2-135M-Instruct, GGUF Q4_1):
//! splits, agreement with candle, a mixed MLX→candle pipeline, the converted
//! MLX-community layout, batched decode and bad input. MLX on a CPU is slow,
//! so generations stay short.
#![cfg(feature = "mlx")]

use std::path::Path;

use shardplane_engine::candle::CandleStage;
use shardplane_engine::chat::ChatMessage;
use shardplane_engine::gguf::GgufFile;
use shardplane_engine::mlx::{MlxStage, convert};
use shardplane_engine::pipeline::{EngineKind, LocalPipeline, TextModel, generate, parse_stages};
use shardplane_engine::sampler::SamplingParams;
use shardplane_engine::{
    Error, KvPrecision, LoadOptions, Stage, StageInput, StageLayout, StageOutput,
};

fn model() -> (GgufFile, TextModel) {
    let file = GgufFile::open(shardplane_testkit::test_model()).expect("the test model opens");
    let text = TextModel::from_gguf(&file).expect("tokenizer and template build");
    (file, text)
}

fn greedy(n: usize) -> SamplingParams {
    SamplingParams {
        max_tokens: n,
        ignore_eos: true,
        ..Default::default()
    }
}

fn chat(text: &TextModel, q: &str) -> Vec<u32> {
    text.chat_prompt(&[ChatMessage::new("user", q)]).unwrap()
}

const PROMPTS: [&str; 3] = [
    "Why is the sky blue?",
    "Write a haiku about autumn leaves.",
    "What is 12 times 7? Explain briefly.",
];

fn tokens(p: &mut LocalPipeline, text: &TextModel, prompt: &[u32], n: usize) -> Vec<u32> {
    generate(p, text, 1, prompt, &greedy(n), |_| {})
        .unwrap()
        .tokens
}

fn mlx(file: &GgufFile, stages: &str) -> LocalPipeline {
    let splits = parse_stages(stages, 30).unwrap();
    LocalPipeline::load(file, &splits, EngineKind::Mlx, &LoadOptions::default()).unwrap()
}

#[test]
fn whole_and_split_models_give_the_same_greedy_tokens_under_mlx() {
    let (file, text) = model();
    eprintln!(
        "MLX {} on {}",
        shardplane_engine::mlx::version(),
        shardplane_engine::mlx::blas()
    );
    let prompt = chat(&text, PROMPTS[0]);
    let whole = tokens(&mut mlx(&file, "0-29"), &text, &prompt, 12);
    assert_eq!(whole.len(), 12);
    for split in ["0-14,15-29", "0-9,10-19,20-29"] {
        assert_eq!(
            tokens(&mut mlx(&file, split), &text, &prompt, 12),
            whole,
            "split {split}"
        );
    }
    // "The answer to this question lies in the intricate dance of light"
    let reply = text.tokenizer.decode(&whole, true).unwrap();
    assert!(
        reply.contains("answer") && reply.contains("light"),
        "{reply}"
    );
}

/// candle with the file's own Q4_1 weights (no re-quantization) and an f32
/// KV cache as MLX's, so both engines start from the same numbers.
fn candle_same_weights(file: &GgufFile) -> LocalPipeline {
    let options = LoadOptions {
        requantize_slow_types: false,
        kv_precision: KvPrecision::F32,
        ..Default::default()
    };
    LocalPipeline::load(file, &[], EngineKind::Candle, &options).unwrap()
}

#[test]
fn mlx_and_candle_agree_on_the_first_16_greedy_tokens_of_three_prompts() {
    let (file, text) = model();
    let mut m = mlx(&file, "0-29");
    let mut c = candle_same_weights(&file);
    for q in PROMPTS {
        let prompt = chat(&text, q);
        let (a, b) = (
            tokens(&mut m, &text, &prompt, 16),
            tokens(&mut c, &text, &prompt, 16),
        );
        assert_eq!(a, b, "prompt {q:?}: mlx {a:?} candle {b:?}");
    }
}

/// The largest difference between two logit vectors, relative to the spread
/// of the first.
fn logit_gap(a: &[f32], b: &[f32]) -> f32 {
    let max = a.iter().cloned().fold(f32::MIN, f32::max);
    let min = a.iter().cloned().fold(f32::MAX, f32::min);
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
        / (max - min)
}

fn candle_f32(file: &GgufFile, layers: std::ops::Range<usize>) -> Box<dyn Stage> {
    let options = LoadOptions {
        dequantize: true,
        kv_precision: KvPrecision::F32,
        ..Default::default()
    };
    let layout = StageLayout::new(layers, 30).unwrap();
    Box::new(CandleStage::load_from(file, layout, &options, candle_core::Device::Cpu).unwrap())
}

#[test]
fn prefill_logits_of_mlx_and_candle_are_close() {
    let (file, text) = model();
    let prompt = chat(&text, PROMPTS[0]);
    let mut m = mlx(&file, "0-29");
    let a = m.step(vec![(1, prompt.clone())]).unwrap().remove(0);
    let gap =
        |mut c: LocalPipeline| logit_gap(&a, &c.step(vec![(1, prompt.clone())]).unwrap().remove(0));
    let exact = gap(LocalPipeline::from_stages(vec![candle_f32(&file, 0..30)]));
    let q4_1 = gap(candle_same_weights(&file));
    let mlx_f32 = gap(LocalPipeline::from_stages(vec![Box::new(
        MlxStage::load_gguf(
            &file,
            StageLayout::whole(30),
            &LoadOptions {
                dequantize: true,
                ..Default::default()
            },
        )
        .unwrap(),
    )]));
    let q8_0 =
        gap(LocalPipeline::load(&file, &[], EngineKind::Candle, &LoadOptions::default()).unwrap());
    eprintln!(
        "largest prefill logit difference from MLX, as a fraction of the logit range: \
         MLX dequantized {mlx_f32:.6}, candle f32 {exact:.6}, candle Q4_1 kernels {q4_1:.5}, \
         candle Q8_0 (default) {q8_0:.5}"
    );
    assert!(mlx_f32 < 1e-3, "MLX dequantized differs by {mlx_f32}");
    // The same weights multiplied in f32 differ only by summation order.
    assert!(exact < 1e-3, "candle f32 differs by {exact}");
    // candle's quantized kernels round activations to 8 bits before the dot
    // product; that is the whole remaining difference.
    assert!(q4_1 < 0.05, "candle Q4_1 differs by {q4_1}");
}

#[test]
fn a_mixed_pipeline_mlx_then_candle_gives_the_tokens_of_mlx_alone() {
    let (file, text) = model();
    let prompt = chat(&text, PROMPTS[1]);
    let alone = tokens(&mut mlx(&file, "0-29"), &text, &prompt, 12);
    let first: Box<dyn Stage> = Box::new(
        MlxStage::load_gguf(
            &file,
            StageLayout::new(0..15, 30).unwrap(),
            &LoadOptions::default(),
        )
        .unwrap(),
    );
    // candle multiplying in f32 as MLX does: its default quantized kernels
    // round activations to 8 bits and part from MLX's path after ~10 tokens here.
    let mut mixed = LocalPipeline::from_stages(vec![first, candle_f32(&file, 15..30)]);
    let got = tokens(&mut mixed, &text, &prompt, 12);
    assert_eq!(got, alone, "mixed {got:?} vs mlx {alone:?}");
}

#[test]
fn the_converted_mlx_layout_gives_the_same_tokens_as_the_gguf() {
    let (file, text) = model();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("smollm2-mlx");
    let converted = convert::gguf_to_mlx(file.path(), &out).unwrap();
    // 30 layers × 9 weights + embedding + final norm (the head is tied).
    assert_eq!(
        converted.tensors,
        30 * 9 + 2 + 7 * 30 * 2 + 2,
        "{converted:?}"
    );
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["quantization"]["bits"], 4);
    assert_eq!(config["quantization"]["group_size"], 32);
    assert_eq!(config["quantization"]["model.embed_tokens"]["bits"], 8);
    assert_eq!(config["tie_word_embeddings"], true);
    assert_eq!(config["num_hidden_layers"], 30);

    // The directory's own tokenizer and template give the same prompt.
    let dir_text = TextModel::from_dir(&out).unwrap();
    let prompt = chat(&text, PROMPTS[2]);
    assert_eq!(chat(&dir_text, PROMPTS[2]), prompt);
    assert_eq!(
        dir_text.tokenizer.stop_tokens(),
        text.tokenizer.stop_tokens()
    );

    let gguf = tokens(&mut mlx(&file, "0-29"), &text, &prompt, 12);
    let load = |range: std::ops::Range<usize>| -> Box<dyn Stage> {
        Box::new(
            MlxStage::load(
                &out,
                StageLayout::new(range, 30).unwrap(),
                &LoadOptions::default(),
            )
            .unwrap(),
        )
    };
    let mut whole = LocalPipeline::from_stages(vec![load(0..30)]);
    assert_eq!(tokens(&mut whole, &dir_text, &prompt, 12), gguf);
    let mut split = LocalPipeline::from_stages(vec![load(0..12), load(12..30)]);
    assert_eq!(tokens(&mut split, &dir_text, &prompt, 12), gguf);
}

#[test]
fn batched_decode_matches_each_sequence_alone() {
    let (file, text) = model();
    let layout = StageLayout::whole(30);
    let mut shard = MlxStage::load_gguf(&file, layout, &LoadOptions::default()).unwrap();
    let prompts: Vec<Vec<u32>> = PROMPTS.iter().map(|q| chat(&text, q)).collect();
    let argmax = |o: StageOutput| match o {
        StageOutput::Logits(l) => {
            l.iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .unwrap()
                .0 as u32
        }
        StageOutput::Hidden(_) => panic!("the whole model gives logits"),
    };
    // Each alone.
    let mut alone = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let seq = 100 + i as u64;
        let mut t = argmax(shard.forward(seq, StageInput::Tokens(p.clone())).unwrap());
        let mut out = vec![t];
        for _ in 0..5 {
            t = argmax(shard.forward(seq, StageInput::Tokens(vec![t])).unwrap());
            out.push(t);
        }
        assert!(shard.release(seq));
        alone.push(out);
    }
    assert_eq!(shard.sequences(), 0);
    assert_eq!(shard.kv_cache_bytes(), 0);
    // Together: prefill each, then decode all three in one batch per step.
    let mut last: Vec<u32> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            argmax(
                shard
                    .forward(i as u64, StageInput::Tokens(p.clone()))
                    .unwrap(),
            )
        })
        .collect();
    let mut together: Vec<Vec<u32>> = last.iter().map(|&t| vec![t]).collect();
    for _ in 0..5 {
        let batch = last
            .iter()
            .enumerate()
            .map(|(i, &t)| (i as u64, StageInput::Tokens(vec![t])))
            .collect();
        last = shard
            .forward_batch(batch)
            .unwrap()
            .into_iter()
            .map(argmax)
            .collect();
        for (i, &t) in last.iter().enumerate() {
            together[i].push(t);
        }
    }
    assert_eq!(together, alone);
    assert_eq!(shard.sequence_len(0), prompts[0].len() + 5);
    // 3 sequences × 30 layers × K and V × 3 heads × 256 slots × 64 × f32.
    assert_eq!(shard.kv_cache_bytes(), 3 * 30 * 2 * 3 * 256 * 64 * 4);
}

#[test]
fn bad_input_and_bad_files_are_errors_not_crashes() {
    let (file, _) = model();
    let mut whole =
        MlxStage::load_gguf(&file, StageLayout::whole(30), &LoadOptions::default()).unwrap();
    let e = whole
        .forward(1, StageInput::Tokens(vec![49_152]))
        .unwrap_err();
    assert!(e.to_string().contains("outside the vocabulary"), "{e}");
    assert_eq!(whole.sequences(), 0);
    let e = whole
        .forward(
            1,
            StageInput::Hidden(shardplane_engine::Activations::new(1, 4, vec![0.0; 4]).unwrap()),
        )
        .unwrap_err();
    assert!(e.to_string().contains("width 4"), "{e}");
    let small = LoadOptions {
        context_length: Some(8),
        ..Default::default()
    };
    let mut tail =
        MlxStage::load_gguf(&file, StageLayout::new(20..30, 30).unwrap(), &small).unwrap();
    let e = tail.forward(1, StageInput::Tokens(vec![1, 2])).unwrap_err();
    assert!(e.to_string().contains("does not start the model"), "{e}");
    let e = whole
        .forward_batch(vec![
            (1, StageInput::Tokens(vec![1, 2])),
            (1, StageInput::Tokens(vec![3])),
        ])
        .unwrap_err();
    assert!(e.to_string().contains("appears twice in one step"), "{e}");
    let e = tail
        .forward(
            2,
            StageInput::Hidden(
                shardplane_engine::Activations::new(9, 576, vec![0.0; 9 * 576]).unwrap(),
            ),
        )
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::ContextOverflow {
                needed: 9,
                context: 8
            }
        ),
        "{e}"
    );

    // A truncated GGUF and a garbage safetensors file fail to load with a message.
    let dir = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(file.path()).unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    match MlxStage::load(&cut, StageLayout::whole(30), &LoadOptions::default()) {
        Err(e) => assert!(!e.to_string().is_empty()),
        Ok(_) => panic!("half a GGUF file loaded"),
    }
    let out = dir.path().join("m");
    convert::gguf_to_mlx(file.path(), &out).unwrap();
    let weights = out.join("model.safetensors");
    let data = std::fs::read(&weights).unwrap();
    std::fs::write(&weights, &data[..data.len() / 3]).unwrap();
    let e = MlxStage::load(&out, StageLayout::whole(30), &LoadOptions::default()).unwrap_err();
    assert!(
        matches!(e, Error::Mlx(_) | Error::CorruptModel { .. }),
        "{e}"
    );
    std::fs::write(out.join("config.json"), "{\"model_type\": \"llama\"}").unwrap();
    let e = MlxStage::load(&out, StageLayout::whole(30), &LoadOptions::default()).unwrap_err();
    assert!(e.to_string().contains("config.json hidden_size"), "{e}");
    assert!(!Path::new(&out).join("missing").exists());
}
