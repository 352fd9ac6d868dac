//! Model files: every supported weight type loads and generates, and broken
//! files (truncated, corrupt, unknown tensor type or architecture, a layer
//! range past the model) fail with a clear error, never a panic.

use std::fs::File;
use std::io::{BufReader, BufWriter};
use std::path::{Path, PathBuf};

use candle_core::Device;
use candle_core::quantized::gguf_file::{self, Content, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use shardplane_engine::candle::CandleStage;
use shardplane_engine::chat::ChatMessage;
use shardplane_engine::gguf::GgufFile;
use shardplane_engine::pipeline::{EngineKind, LocalPipeline, TextModel, generate};
use shardplane_engine::sampler::SamplingParams;
use shardplane_engine::{Error, LoadOptions, Stage, StageLayout};

fn model() -> PathBuf {
    shardplane_testkit::test_model()
}

/// Rewrites the test model with every weight matrix in `dtype` (K-quant types
/// need rows that are a multiple of 256; other matrices get `fallback`).
fn convert(dtype: GgmlDType, fallback: GgmlDType, dir: &Path) -> PathBuf {
    convert_file(&model(), dtype, fallback, dir)
}

/// Rewrites the model `source` so, as candle decodes its values.
fn convert_file(source: &Path, dtype: GgmlDType, fallback: GgmlDType, dir: &Path) -> PathBuf {
    let mut reader = BufReader::new(File::open(source).unwrap());
    let content = Content::read(&mut reader).unwrap();
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let tensors: Vec<(String, QTensor)> = names
        .iter()
        .map(|name| {
            let t = content.tensor(&mut reader, name, &Device::Cpu).unwrap();
            let dims = t.shape().dims().to_vec();
            let values = t.dequantize(&Device::Cpu).unwrap();
            let row = *dims.last().unwrap();
            let target = if dims.len() == 1 {
                GgmlDType::F32
            } else if row.is_multiple_of(dtype.block_size()) {
                dtype
            } else {
                fallback
            };
            (
                name.to_string(),
                QTensor::quantize(&values, target).unwrap(),
            )
        })
        .collect();
    let mut keys: Vec<&String> = content.metadata.keys().collect();
    keys.sort();
    let metadata: Vec<(&str, &Value)> = keys
        .iter()
        .map(|k| (k.as_str(), &content.metadata[*k]))
        .collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let stem = source.file_stem().unwrap().to_string_lossy();
    let path = dir.join(format!("{stem}-{dtype:?}.gguf"));
    let mut out = BufWriter::new(File::create(&path).unwrap());
    gguf_file::write(&mut out, &metadata, &tensor_refs).unwrap();
    path
}

/// llama.cpp's greedy reply (2 threads, same file) to "Why is the sky blue?"
/// through the model's chat template.
const LLAMA_CPP_SKY: [u32; 32] = [
    504, 2988, 288, 451, 1962, 5721, 281, 260, 7564, 7180, 282, 11367, 6756, 284, 260, 1205, 8302,
    282, 1420, 30, 1550, 1420, 13242, 6756, 282, 913, 28, 4983, 28, 284, 550, 9159,
];

fn greedy_tokens(path: &Path, options: &LoadOptions, n: usize) -> (Vec<u32>, String) {
    let file = GgufFile::open(path).unwrap();
    let text = TextModel::from_gguf(&file).unwrap();
    let mut p = LocalPipeline::load(&file, &[0..15, 15..30], EngineKind::Candle, options).unwrap();
    let prompt = text
        .chat_prompt(&[ChatMessage::new("user", "Why is the sky blue?")])
        .unwrap();
    let params = SamplingParams {
        max_tokens: n,
        ignore_eos: true,
        ..Default::default()
    };
    let g = generate(&mut p, &text, 1, &prompt, &params, |_| {}).unwrap();
    (g.tokens, g.text)
}

#[test]
fn every_weight_type_loads_and_generates() {
    let dir = tempfile::tempdir().unwrap();
    let exact = LoadOptions {
        requantize_slow_types: false,
        ..Default::default()
    };
    let (reference, _) = greedy_tokens(&model(), &exact, 32);
    assert_eq!(
        reference[..11],
        LLAMA_CPP_SKY[..11],
        "llama.cpp's first tokens"
    );

    // F32 holds the Q4_1 weights exactly; quantized matmuls round activations
    // (to Q8_1 for Q4_1), so the two may part where two tokens are nearly tied.
    let (f32_tokens, _) = greedy_tokens(
        &convert(GgmlDType::F32, GgmlDType::F32, dir.path()),
        &exact,
        32,
    );
    let agree = f32_tokens
        .iter()
        .zip(&reference)
        .take_while(|(a, b)| a == b)
        .count();
    assert!(
        agree >= 11,
        "F32 and Q4_1 agree on {agree} tokens: {f32_tokens:?} vs {reference:?}"
    );

    // The others round the weights again; the reply must still be about the sky.
    for (dtype, fallback) in [
        (GgmlDType::F16, GgmlDType::F16),
        (GgmlDType::BF16, GgmlDType::BF16),
        (GgmlDType::Q8_0, GgmlDType::Q8_0),
        (GgmlDType::Q4_0, GgmlDType::Q4_0),
        (GgmlDType::Q4K, GgmlDType::Q8_0),
        (GgmlDType::Q6K, GgmlDType::Q8_0),
    ] {
        let path = convert(dtype, fallback, dir.path());
        let (tokens, text) = greedy_tokens(&path, &LoadOptions::default(), 24);
        assert_eq!(tokens.len(), 24, "{dtype:?}");
        let lower = text.to_lowercase();
        assert!(
            ["sky", "blue", "light", "scatter", "atmosphere"]
                .iter()
                .any(|w| lower.contains(w)),
            "{dtype:?} generated {text:?}"
        );
        std::fs::remove_file(path).unwrap();
    }
}

/// Rewrites the test model in F32 as architecture `arch`: Q/K rows
/// un-permuted from GGUF's interleaved-RoPE order back to halves (NeoX) order,
/// zero Q/K/V biases, and for qwen3 unit Q/K norms. With zero biases a qwen2
/// model is the same function as the llama original in F32.
fn as_architecture(arch: &str, dir: &Path) -> PathBuf {
    use candle_core::Tensor;
    let mut reader = BufReader::new(File::open(model()).unwrap());
    let content = Content::read(&mut reader).unwrap();
    let (heads, kv_heads, hd) = (9usize, 3usize, 64usize);
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    for name in content.tensor_infos.keys() {
        let t = content.tensor(&mut reader, name, &Device::Cpu).unwrap();
        // Everything in F32, so the comparison is with the same numbers.
        let w = t.dequantize(&Device::Cpu).unwrap();
        let n_heads = if name.ends_with("attn_q.weight") {
            heads
        } else if name.ends_with("attn_k.weight") {
            kv_heads
        } else {
            tensors.push((name.clone(), QTensor::quantize(&w, GgmlDType::F32).unwrap()));
            continue;
        };
        let cols = w.dim(1).unwrap();
        // Row order within a head: (hd/2, 2) interleaved -> (2, hd/2) halves.
        let w = w
            .reshape((n_heads, hd / 2, 2, cols))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .reshape((n_heads * hd, cols))
            .unwrap();
        tensors.push((name.clone(), QTensor::quantize(&w, GgmlDType::F32).unwrap()));
    }
    for layer in 0..30 {
        for (suffix, len) in [
            ("attn_q.bias", heads * hd),
            ("attn_k.bias", kv_heads * hd),
            ("attn_v.bias", kv_heads * hd),
        ] {
            let zeros = Tensor::zeros(len, candle_core::DType::F32, &Device::Cpu).unwrap();
            tensors.push((
                format!("blk.{layer}.{suffix}"),
                QTensor::quantize(&zeros, GgmlDType::F32).unwrap(),
            ));
        }
        if arch == "qwen3" {
            for suffix in ["attn_q_norm.weight", "attn_k_norm.weight"] {
                let ones = Tensor::ones(hd, candle_core::DType::F32, &Device::Cpu).unwrap();
                tensors.push((
                    format!("blk.{layer}.{suffix}"),
                    QTensor::quantize(&ones, GgmlDType::F32).unwrap(),
                ));
            }
        }
    }
    let mut metadata: Vec<(String, Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.replacen("llama.", &format!("{arch}."), 1), v.clone()))
        .collect();
    for (k, v) in metadata.iter_mut() {
        if k == "general.architecture" {
            *v = Value::String(arch.to_string());
        }
    }
    metadata.sort_by(|a, b| a.0.cmp(&b.0));
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let meta_refs: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let path = dir.join(format!("model-{arch}.gguf"));
    let mut out = BufWriter::new(File::create(&path).unwrap());
    gguf_file::write(&mut out, &meta_refs, &tensor_refs).unwrap();
    path
}

#[test]
fn qwen2_and_qwen3_layouts_run_and_qwen2_matches_llama() {
    let dir = tempfile::tempdir().unwrap();
    let exact = LoadOptions {
        requantize_slow_types: false,
        ..Default::default()
    };
    let (llama, _) = greedy_tokens(
        &convert(GgmlDType::F32, GgmlDType::F32, dir.path()),
        &exact,
        16,
    );
    let qwen2 = as_architecture("qwen2", dir.path());
    assert_eq!(
        GgufFile::open(&qwen2).unwrap().config().architecture,
        shardplane_engine::Architecture::Qwen2
    );
    let (tokens, _) = greedy_tokens(&qwen2, &exact, 16);
    assert_eq!(
        tokens, llama,
        "NeoX RoPE on un-permuted weights with zero biases is the same model"
    );

    // Per-head Q/K norms change the function: it must load and run, whatever it says.
    let qwen3 = as_architecture("qwen3", dir.path());
    let (tokens, _) = greedy_tokens(&qwen3, &exact, 8);
    assert_eq!(tokens.len(), 8);
}

fn broken_copy(dir: &Path, name: &str, edit: impl FnOnce(&mut Vec<u8>)) -> PathBuf {
    let mut bytes = std::fs::read(model()).unwrap();
    edit(&mut bytes);
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn find(bytes: &[u8], needle: &[u8]) -> usize {
    bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .expect("pattern is in the file")
}

fn load_whole(path: &Path) -> Result<CandleStage, Error> {
    CandleStage::load(path, StageLayout::whole(30), &LoadOptions::default())
}

#[test]
fn truncated_and_corrupt_files_fail_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    // Cut in the tensor data: the header reads, the last tensors are missing.
    let truncated = broken_copy(dir.path(), "truncated.gguf", |b| b.truncate(b.len() / 2));
    let e = load_whole(&truncated).expect_err("a truncated file fails");
    assert!(matches!(e, Error::CorruptModel { .. }), "{e}");
    assert!(e.to_string().contains("truncated or corrupt"), "{e}");
    assert!(
        e.to_string().contains("truncated.gguf"),
        "the error names the file: {e}"
    );

    // Cut in the header.
    let stub = broken_copy(dir.path(), "stub.gguf", |b| b.truncate(4096));
    let e = GgufFile::open(&stub).expect_err("a stub fails");
    assert!(e.to_string().contains("not a valid model file"), "{e}");

    // Not a GGUF file at all.
    let garbage = broken_copy(dir.path(), "garbage.gguf", |b| {
        b.truncate(1 << 20);
        for (i, x) in b.iter_mut().enumerate() {
            *x = (i * 7919 % 251) as u8;
        }
    });
    let e = GgufFile::open(&garbage).expect_err("garbage fails");
    assert!(e.to_string().contains("not a valid model file"), "{e}");

    let e = GgufFile::open(dir.path().join("absent.gguf")).expect_err("a missing file fails");
    assert!(e.to_string().contains("cannot read model file"), "{e}");
}

#[test]
fn an_unknown_tensor_type_or_architecture_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let unknown_type = broken_copy(dir.path(), "type.gguf", |b| {
        // token_embd.weight's entry: name, 2 dims, 2 u64 sizes, then the u32 type.
        let name = b"token_embd.weight";
        let at = find(b, name) + name.len() + 4 + 16;
        b[at..at + 4].copy_from_slice(&99u32.to_le_bytes());
    });
    let e = GgufFile::open(&unknown_type).expect_err("an unknown type fails");
    assert!(matches!(e, Error::UnsupportedTensorType { .. }), "{e}");
    assert!(e.to_string().contains("ggml type 99"), "{e}");

    let unknown_arch = broken_copy(dir.path(), "arch.gguf", |b| {
        let key = b"general.architecture";
        let at = find(b, key) + key.len() + 4 + 8;
        assert_eq!(&b[at..at + 5], b"llama");
        b[at..at + 5].copy_from_slice(b"mamba");
    });
    let e = GgufFile::open(&unknown_arch).expect_err("an unknown architecture fails");
    assert!(
        e.to_string()
            .contains("architecture \"mamba\" is not supported"),
        "{e}"
    );
}

#[test]
fn a_layer_range_past_the_model_is_an_error() {
    let file = GgufFile::open(model()).unwrap();
    for (start, end) in [(20, 31), (10, 10), (12, 5)] {
        let e = StageLayout::new(start..end, 30).expect_err("bad range");
        assert!(
            e.to_string().contains(&format!(
                "layer range {start}-{end} does not fit a model of 30 layers"
            )),
            "{e}"
        );
    }
    // A layout built for a bigger model is checked against the file too.
    let layout = StageLayout::new(20..40, 40).unwrap();
    let e = CandleStage::load_from(&file, layout, &LoadOptions::default(), Device::Cpu)
        .expect_err("past the end");
    assert!(matches!(e, Error::LayerRange { layers: 30, .. }), "{e}");
}

/// MLX holds K-quant and 5-bit GGUF matrices as its own groups of the same
/// values: its logits equal those of the file's values as candle decodes
/// them, written as f32 (within summation order), in a fraction of the
/// memory.
#[cfg(feature = "mlx")]
#[test]
fn mlx_holds_k_quants_as_groups_of_the_same_values() {
    use shardplane_engine::mlx::MlxStage;
    use shardplane_engine::{StageInput, StageOutput};
    let dir = tempfile::tempdir().unwrap();
    let text = TextModel::from_gguf(&GgufFile::open(model()).unwrap()).unwrap();
    let prompt = text
        .chat_prompt(&[ChatMessage::new("user", "Why is the sky blue?")])
        .unwrap();
    let logits = |file: &GgufFile| {
        let options = LoadOptions::default();
        let mut stage = MlxStage::load_gguf(file, StageLayout::whole(30), &options).unwrap();
        let bytes = stage.weight_bytes();
        let out = stage
            .forward(1, StageInput::Tokens(prompt.clone()))
            .unwrap();
        let StageOutput::Logits(l) = out else {
            panic!("a whole model gives logits")
        };
        (l, bytes)
    };
    // Rows of 1536 (the feed-forward's down projection) are whole
    // super-blocks of 256; rows of 576 get the 5-bit type of groups of 32.
    // Q6_K, Q3_K and Q2_K (scale groups of 16) are held spread, twice as
    // wide.
    for (dtype, fallback) in [
        (GgmlDType::Q4K, GgmlDType::Q5_0),
        (GgmlDType::Q5K, GgmlDType::Q5_1),
        (GgmlDType::Q6K, GgmlDType::Q8_0),
        (GgmlDType::Q3K, GgmlDType::Q4_0),
        (GgmlDType::Q2K, GgmlDType::Q4_1),
    ] {
        let quantized = convert(dtype, fallback, dir.path());
        let decoded = convert_file(&quantized, GgmlDType::F32, GgmlDType::F32, dir.path());
        let (grouped, grouped_bytes) = logits(&GgufFile::open(&quantized).unwrap());
        let (exact, f32_bytes) = logits(&GgufFile::open(&decoded).unwrap());
        let range = exact.iter().cloned().fold(f32::MIN, f32::max)
            - exact.iter().cloned().fold(f32::MAX, f32::min);
        let gap = exact
            .iter()
            .zip(&grouped)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max)
            / range;
        eprintln!(
            "{dtype:?}/{fallback:?} on MLX: logit gap to candle's decoding as f32 {gap:.2e} of the range; \
             {grouped_bytes} bytes as groups, {f32_bytes} as f32"
        );
        assert!(gap < 1e-4, "{dtype:?}: {gap}");
        // At least 2.5× smaller (Q6_K's spread groups take 16 bits a value,
        // Q8_0's groups 10).
        assert!(
            grouped_bytes * 5 < f32_bytes * 2,
            "{grouped_bytes} vs {f32_bytes}"
        );
    }
}

/// What placement counts of a model in memory (`shardplane_formats::held`,
/// from the file's tensor directory alone) is what each engine holds when it
/// loads a first and a last stage, for each way an engine treats a type:
/// kept as stored, re-quantized (candle: Q4_1 and Q5_0 to Q8_0), held as
/// groups (MLX), spread (MLX: Q6_K), expanded to f32 (MLX: F16; both:
/// vectors).
#[test]
fn placement_counts_the_bytes_each_engine_holds() {
    use shardplane_formats::held::Holder;
    let dir = tempfile::tempdir().unwrap();
    for (dtype, fallback) in [
        (GgmlDType::F16, GgmlDType::F16),
        (GgmlDType::Q4_1, GgmlDType::Q4_1),
        (GgmlDType::Q4K, GgmlDType::Q5_0),
        (GgmlDType::Q6K, GgmlDType::Q8_0),
    ] {
        let path = convert(dtype, fallback, dir.path());
        let file = GgufFile::open(&path).unwrap();
        let counted = |holder: Holder| {
            let held = holder.held(file.header(), 30);
            let layers = |r: std::ops::Range<usize>| held.layer_bytes[r].iter().sum::<u64>();
            (
                held.embedding_bytes + layers(0..15),
                layers(15..30) + held.output_bytes,
            )
        };
        let layouts = [
            StageLayout::new(0..15, 30).unwrap(),
            StageLayout::new(15..30, 30).unwrap(),
        ];
        let options = LoadOptions::default();
        let candle: Vec<u64> = layouts
            .iter()
            .map(|l| {
                CandleStage::load(&path, l.clone(), &options)
                    .unwrap()
                    .weight_bytes() as u64
            })
            .collect();
        let (first, last) = counted(Holder::Candle);
        assert_eq!(candle, [first, last], "candle, {dtype:?}/{fallback:?}");
        #[cfg(feature = "mlx")]
        {
            use shardplane_engine::mlx::MlxStage;
            let mlx: Vec<u64> = layouts
                .iter()
                .map(|l| {
                    MlxStage::load_gguf(&file, l.clone(), &options)
                        .unwrap()
                        .weight_bytes() as u64
                })
                .collect();
            let (first, last) = counted(Holder::Mlx);
            assert_eq!(mlx, [first, last], "MLX, {dtype:?}/{fallback:?}");
        }
        std::fs::remove_file(path).unwrap();
    }
}
