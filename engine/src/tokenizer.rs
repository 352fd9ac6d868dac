//! Tokenizers built from a model's own files, with the `tokenizers` crate:
//! from GGUF metadata (BPE vocabulary, merges and the pre-tokenizer the file
//! names), from a `tokenizer.json`, or from tiktoken ranks
//! ([`tiktoken`]: `tiktoken.model`).

use std::path::Path;

use shardplane_formats::gguf::{Array, GgufHeader};
use tokenizers::decoders::DecoderWrapper;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::{
    NormalizerWrapper, Prepend, Replace, Sequence as NormalizerSequence,
};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use crate::error::{Error, Result};

mod tiktoken;

/// The files a safetensors model may keep its tokenizer in, in the order
/// they are read: a `tokenizer.json`, else tiktoken ranks.
pub const TOKENIZER_FILES: [&str; 2] = ["tokenizer.json", "tiktoken.model"];

/// GPT-2's split, also what `ByteLevel` applies with `use_regex`.
const GPT2_SPLIT: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Llama 3's split (numbers in groups of up to three).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split (every digit alone).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 3.5's split (combining marks stay with their letters).
const QWEN35_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// GPT-4o's (and Llama 4's) split: words split before capitals.
const GPT4O_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Mistral's Tekken split: as GPT-4o's, without contractions, digits alone.
const TEKKEN_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Kimi K2's split: runs of Han characters, then GPT-4o's without them.
const KIMI_K2_SPLIT: &str = r"[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Chinese, Japanese and Korean runs as DeepSeek's first tokenizers split them.
const DEEPSEEK_CJK: &str = "[\u{4e00}-\u{9fa5}\u{800}-\u{4e00}\u{ac00}-\u{d7ff}]+";
/// DeepSeek LLM's (and V2's) splits. The letters are escaped: several are
/// compatibility characters that editors normalise.
const DEEPSEEK_LLM_SPLITS: &[&str] = &[
    r"[\r\n]",
    concat!(
        r"\s?[",
        "A-Za-z\u{b5}\u{c0}-\u{d6}\u{d8}-\u{f6}\u{f8}-\u{1ba}\u{1bc}-\u{1bf}\u{1c4}-\u{293}\u{295}-\u{2af}\u{370}-\u{373}\u{376}\u{377}\u{37b}-\u{37d}\u{37f}\u{386}\u{388}-\u{38a}\u{38c}\u{38e}-\u{3a1}\u{3a3}-\u{3f5}\u{3f7}-\u{481}\u{48a}-\u{52f}\u{531}-\u{556}\u{10a0}-\u{10c5}\u{13a0}-\u{13f5}\u{13f8}-\u{13fd}\u{1c90}-\u{1cba}\u{1cbd}-\u{1cbf}\u{1d00}-\u{1d2b}\u{1d6b}-\u{1d77}\u{1d79}-\u{1d9a}\u{1e00}-\u{1f15}\u{1f18}-\u{1f1d}\u{1f20}-\u{1f45}\u{1f48}-\u{1f4d}\u{1f50}-\u{1f57}\u{1f59}\u{1f5b}\u{1f5d}\u{1f5f}-\u{1f7d}\u{1f80}-\u{1fb4}\u{1fb6}-\u{1fbc}\u{1fbe}\u{1fc2}-\u{1fc4}\u{1fc6}-\u{1fcc}\u{1fd0}-\u{1fd3}\u{1fd6}-\u{1fdb}\u{1fe0}-\u{1fec}\u{1ff2}-\u{1ff4}\u{1ff6}-\u{1ffc}\u{2102}\u{2107}\u{210a}-\u{2113}\u{2115}\u{2119}-\u{211d}\u{2124}\u{2126}\u{2128}\u{212a}-\u{212d}\u{212f}-\u{2134}\u{2139}\u{213c}-\u{213f}\u{2145}-\u{2149}\u{214e}\u{2183}\u{2184}\u{2c00}-\u{2c7b}\u{2c7e}-\u{2ce4}\u{2ceb}-\u{2cee}\u{2cf2}\u{2cf3}\u{a640}-\u{a66d}\u{a680}-\u{a69b}\u{a722}-\u{a76f}\u{a771}-\u{a787}\u{a78b}-\u{a78e}\u{ab70}-\u{abbf}\u{fb00}-\u{fb06}\u{fb13}-\u{fb17}\u{ff21}-\u{ff3a}\u{ff41}-\u{ff5a}\u{10400}-\u{1044f}\u{104b0}-\u{104d3}\u{104d8}-\u{104fb}\u{10c80}-\u{10cb2}\u{10cc0}-\u{10cf2}\u{118a0}-\u{118df}\u{1e900}-\u{1e943}",
        "]+"
    ),
    concat!(
        r"\s?[!-/:-~",
        "\u{ff01}-\u{ff0f}\u{ff1a}-\u{ff5e}\u{2018}-\u{201f}\u{3000}-\u{3002}",
        "]+"
    ),
    r"\s+$",
    DEEPSEEK_CJK,
    r"\p{N}+",
];
/// DeepSeek Coder's splits.
const DEEPSEEK_CODER_SPLITS: &[&str] = &[
    r"[\r\n]",
    r"\s?\p{L}+",
    r"\s?\p{P}+",
    DEEPSEEK_CJK,
    r"\p{N}",
];
/// DeepSeek V3's (and R1's) splits.
const DEEPSEEK_V3_SPLITS: &[&str] = &[
    r"\p{N}{1,3}",
    "[\u{4e00}-\u{9fa5}\u{3040}-\u{309f}\u{30a0}-\u{30ff}]+",
    r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
];

/// How a GGUF `tokenizer.ggml.pre` type pre-tokenizes, as the family's own
/// tokenizer does and llama.cpp reads the type: splits, each applied to the
/// pieces of the one before; and whether a piece found whole in the
/// vocabulary is taken as it is instead of merged (`ignore_merges`).
struct PreType {
    names: &'static [&'static str],
    splits: &'static [&'static str],
    ignore_merges: bool,
}

const fn pre(
    names: &'static [&'static str],
    splits: &'static [&'static str],
    ignore_merges: bool,
) -> PreType {
    PreType {
        names,
        splits,
        ignore_merges,
    }
}

/// The pre-tokenizer types read, by family.
const PRE_TYPES: &[PreType] = &[
    pre(
        &[
            "gpt-2",
            "default",
            "phi-2",
            "jais",
            "mpt",
            "olmo",
            "exaone4",
            "gigachat",
            "a.x-4.0",
            "mellum",
            "trillion",
            "granite-docling",
        ],
        &[GPT2_SPLIT],
        false,
    ),
    pre(
        &[
            "llama-bpe",
            "llama3",
            "llama-v3",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "lfm2",
            "midm-2.0",
        ],
        &[LLAMA3_SPLIT],
        true,
    ),
    pre(
        &["dbrx", "smaug-bpe", "chatglm-bpe"],
        &[LLAMA3_SPLIT],
        false,
    ),
    pre(&["glm4", "glm5"], &[LLAMA3_SPLIT], true),
    pre(
        &[
            "qwen2",
            "deepseek-r1-qwen",
            "megrez",
            "stablelm2",
            "hunyuan",
            "kormo",
            "f2llmv2",
            "solar-open",
            "grok-2",
        ],
        &[QWEN2_SPLIT],
        false,
    ),
    pre(&["qwen35"], &[QWEN35_SPLIT], false),
    // Every number character alone, then GPT-2's split.
    pre(
        &[
            "smollm",
            "starcoder",
            "refact",
            "command-r",
            "codeshell",
            "exaone",
            "minerva-7b",
            "mellum2",
        ],
        &[r"\p{N}", GPT2_SPLIT],
        false,
    ),
    pre(&["deepseek-llm"], DEEPSEEK_LLM_SPLITS, false),
    pre(&["deepseek-coder"], DEEPSEEK_CODER_SPLITS, false),
    pre(
        &["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"],
        DEEPSEEK_V3_SPLITS,
        false,
    ),
    pre(&["kimi-k2"], &[KIMI_K2_SPLIT], false),
    pre(
        &["gpt-4o", "llama4", "minimax-m2", "kanana2", "talkie"],
        &[GPT4O_SPLIT],
        false,
    ),
    pre(&["tekken"], &[TEKKEN_SPLIT], true),
];

/// GGUF token types (llama.cpp's): control and user-defined tokens are
/// matched whole in text; unknown and byte tokens never come from merges.
const TOKEN_TYPE_UNKNOWN: i64 = 2;
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;
const TOKEN_TYPE_BYTE: i64 = 6;

/// SentencePiece's visible space.
const SPM_SPACE: &str = "\u{2581}";

/// A tokenizer and the model's special tokens.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos: Option<u32>,
    add_bos: bool,
    stop_tokens: Vec<u32>,
    keeps_markup: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab", &self.inner.get_vocab_size(true))
            .field("bos", &self.bos)
            .field("stop_tokens", &self.stop_tokens)
            .finish()
    }
}

fn tok_err(e: impl std::fmt::Display) -> Error {
    Error::Tokenizer(e.to_string())
}

fn split(pattern: &str) -> Result<PreTokenizerWrapper> {
    let split = Split::new(
        SplitPattern::Regex(pattern.into()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(tok_err)?;
    Ok(split.into())
}

/// The pre-tokenizer type a GGUF `tokenizer.ggml.pre` value names. A file
/// without one (or saying `default`) splits as GPT-2 does; llama.cpp splits
/// such a file's punctuation runs and digit triples apart first, which is
/// not followed here (the files converters write today all name a type).
fn pre_type(name: &str) -> Result<&'static PreType> {
    PRE_TYPES
        .iter()
        .find(|t| t.names.contains(&name))
        .ok_or_else(|| {
            let known: Vec<&str> = PRE_TYPES
                .iter()
                .flat_map(|t| t.names.iter().copied())
                .collect();
            Error::Tokenizer(format!(
                "GGUF pre-tokenizer type (tokenizer.ggml.pre) {name:?} is not supported; \
                 supported are {}",
                known.join(", ")
            ))
        })
}

/// The splits, then bytes mapped to GPT-2's visible characters.
fn pre_tokenizer(pre: &PreType) -> Result<PreTokenizerWrapper> {
    let mut steps = pre
        .splits
        .iter()
        .map(|pattern| split(pattern))
        .collect::<Result<Vec<_>>>()?;
    steps.push(ByteLevel::new(false, true, false).into());
    Ok(Sequence::new(steps).into())
}

/// Byte-level BPE from GGUF's vocabulary and merges, split first as the
/// file's pre-tokenizer type says.
fn byte_level_bpe(header: &GgufHeader, tokens: &[String]) -> Result<tokenizers::Tokenizer> {
    let merges = header.get_strings("tokenizer.ggml.merges")?;
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), i as u32))
        .collect();
    let merges = merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| Error::Tokenizer(format!("merge {m:?} is not two tokens")))
        })
        .collect::<Result<Vec<_>>>()?;
    let pre = pre_type(header.get_str("tokenizer.ggml.pre").unwrap_or("default"))?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(pre.ignore_merges)
        .build()
        .map_err(tok_err)?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    inner.with_pre_tokenizer(Some(pre_tokenizer(pre)?));
    inner.with_decoder(Some(ByteLevelDecoder::default()));
    Ok(inner)
}

/// SentencePiece BPE as llama.cpp runs it from GGUF: spaces become `▁` (one
/// is put before the text, and after each special token, when the file asks
/// for the space prefix); adjacent pieces merge best score first; a
/// character outside the vocabulary falls back to its `<0xXX>` byte tokens.
/// Expressed as a BPE whose merges are every split of every piece into two
/// pieces, ordered by the whole piece's score (ties by ids, as Hugging
/// Face's converter orders them).
fn sentencepiece_bpe(
    header: &GgufHeader,
    tokens: &[String],
    types: &[i64],
) -> Result<tokenizers::Tokenizer> {
    let scores: Vec<f64> = match header.get("tokenizer.ggml.scores") {
        Ok(v) => match v.as_array() {
            Some(Array::Float(f)) if f.len() == tokens.len() => f.clone(),
            _ => {
                return Err(Error::Tokenizer(format!(
                    "tokenizer.ggml.scores is not {} numbers, one per token",
                    tokens.len()
                )));
            }
        },
        // No scores: earlier pieces first, as SentencePiece numbers them.
        Err(_) => (0..tokens.len()).map(|i| -(i as f64)).collect(),
    };
    let mut vocab = tokenizers::models::bpe::Vocab::default();
    for (i, t) in tokens.iter().enumerate() {
        vocab.entry(t.clone()).or_insert(i as u32);
    }
    let mut merges: Vec<(f64, u32, u32, u32)> = Vec::new();
    for (id, piece) in tokens.iter().enumerate() {
        let kind = types.get(id).copied().unwrap_or(1);
        if matches!(
            kind,
            TOKEN_TYPE_UNKNOWN | TOKEN_TYPE_CONTROL | TOKEN_TYPE_BYTE
        ) {
            continue;
        }
        for (k, _) in piece.char_indices().skip(1) {
            if let (Some(&l), Some(&r)) = (vocab.get(&piece[..k]), vocab.get(&piece[k..])) {
                merges.push((scores[id], id as u32, l, r));
            }
        }
    }
    merges.sort_by(|a, b| {
        b.0.total_cmp(&a.0)
            .then(a.1.cmp(&b.1))
            .then(a.2.cmp(&b.2))
            .then(a.3.cmp(&b.3))
    });
    let merges = merges
        .into_iter()
        .map(|(_, _, l, r)| (tokens[l as usize].clone(), tokens[r as usize].clone()))
        .collect();
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .fuse_unk(true);
    let unk = types
        .iter()
        .position(|&t| t == TOKEN_TYPE_UNKNOWN)
        .and_then(|i| tokens.get(i));
    if let Some(unk) = unk {
        builder = builder.unk_token(unk.clone());
    }
    let mut inner = tokenizers::Tokenizer::new(builder.build().map_err(tok_err)?);
    let space_prefix = header
        .get("tokenizer.ggml.add_space_prefix")
        .ok()
        .and_then(|v| v.as_bool())
        .unwrap_or(true);
    let escape = NormalizerWrapper::from(Replace::new(" ", SPM_SPACE).map_err(tok_err)?);
    let normalizer = if space_prefix {
        let prepend = NormalizerWrapper::from(Prepend::new(SPM_SPACE.into()));
        NormalizerWrapper::from(NormalizerSequence::new(vec![prepend, escape]))
    } else {
        escape
    };
    inner.with_normalizer(Some(normalizer));
    let mut decoders = vec![
        DecoderWrapper::from(Replace::new(SPM_SPACE, " ").map_err(tok_err)?),
        DecoderWrapper::from(ByteFallback::new()),
        DecoderWrapper::from(Fuse::new()),
    ];
    if space_prefix {
        decoders.push(DecoderWrapper::from(Strip::new(' ', 1, 0)));
    }
    inner.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(inner)
}

impl Tokenizer {
    /// Builds the tokenizer a GGUF file describes: byte-level BPE
    /// (`tokenizer.ggml.model = gpt2`: SmolLM, Llama 3, Qwen) or
    /// SentencePiece BPE (`llama`: Llama 2, Mistral, Gemma).
    pub fn from_gguf(header: &GgufHeader) -> Result<Self> {
        let model = header.get_str("tokenizer.ggml.model")?;
        let tokens = header.get_strings("tokenizer.ggml.tokens")?;
        let types: Vec<i64> = header
            .get("tokenizer.ggml.token_type")
            .ok()
            .and_then(|v| v.as_array())
            .and_then(Array::to_i64s)
            .unwrap_or_default();
        let (mut inner, add_bos_default) = match model {
            "gpt2" => (byte_level_bpe(header, tokens)?, false),
            "llama" => (sentencepiece_bpe(header, tokens, &types)?, true),
            other => {
                return Err(Error::Tokenizer(format!(
                    "tokenizer model {other:?} is not supported: supported are the byte-level BPE GGUF \
                     calls gpt2 (SmolLM, Llama 3, Qwen) and the SentencePiece BPE it calls llama \
                     (Llama 2, Mistral, Gemma)"
                )));
            }
        };
        let specials: Vec<AddedToken> = types
            .iter()
            .enumerate()
            .filter(|(_, t)| matches!(**t, TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED))
            .filter_map(|(i, _)| tokens.get(i))
            .map(|t| AddedToken::from(t.to_string(), true))
            .collect();
        inner.add_special_tokens(&specials);

        let bos = header.get_u32("tokenizer.ggml.bos_token_id").ok();
        // As llama.cpp: SentencePiece models start with BOS unless the file says not to.
        let add_bos = header
            .get("tokenizer.ggml.add_bos_token")
            .ok()
            .and_then(|v| v.as_bool())
            .unwrap_or(add_bos_default)
            && bos.is_some();
        let mut stop_tokens: Vec<u32> =
            ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"]
                .iter()
                .filter_map(|k| header.get_u32(k).ok())
                .collect();
        // Chat models end a turn with their end-of-turn marker, whichever the file calls EOS.
        for marker in [
            "<|im_end|>",
            "<|eot_id|>",
            "<|end_of_text|>",
            "<|endoftext|>",
            "</s>",
            "<end_of_turn>",
        ] {
            if let Some(id) = inner.token_to_id(marker) {
                stop_tokens.push(id);
            }
        }
        stop_tokens.sort_unstable();
        stop_tokens.dedup();
        Ok(Tokenizer {
            inner,
            bos,
            add_bos,
            stop_tokens,
            keeps_markup: false,
        })
    }

    /// A tokenizer read from a model directory's file: BOS as given (not
    /// added until asked), `eos_token_ids` its stop tokens.
    fn read(inner: tokenizers::Tokenizer, eos_token_ids: &[u32], bos: Option<u32>) -> Self {
        Tokenizer {
            inner,
            bos,
            add_bos: false,
            stop_tokens: eos_token_ids.to_vec(),
            keeps_markup: false,
        }
    }

    /// Loads a `tokenizer.json` (safetensors models); stop tokens come from the
    /// model's `eos_token_id`.
    pub fn from_file(
        path: impl AsRef<Path>,
        eos_token_ids: &[u32],
        bos: Option<u32>,
    ) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(path.as_ref()).map_err(tok_err)?;
        Ok(Self::read(inner, eos_token_ids, bos))
    }

    /// Builds a tokenizer kept as tiktoken ranks (`tiktoken.model` at
    /// `path`) with the special tokens and splits `config`
    /// (`tokenizer_config.json`) gives; stop tokens as
    /// [`Tokenizer::from_file`].
    pub fn from_tiktoken(
        path: impl AsRef<Path>,
        config: &serde_json::Value,
        eos_token_ids: &[u32],
        bos: Option<u32>,
    ) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let inner = tiktoken::tiktoken_bpe(&text, &path.display().to_string(), config)?;
        Ok(Self::read(inner, eos_token_ids, bos))
    }

    /// Whether [`Tokenizer::encode`] with `add_bos` prepends BOS.
    pub fn adds_bos(&self) -> bool {
        self.add_bos
    }

    /// Sets whether [`Tokenizer::encode`] with `add_bos` prepends BOS (from
    /// `tokenizer_config.json`'s `add_bos_token`).
    pub fn set_adds_bos(&mut self, add_bos: bool) {
        self.add_bos = add_bos && self.bos.is_some();
    }

    /// Whether a generation's text keeps special tokens (a model whose
    /// answers are structured by them, as harmony's are).
    pub fn keeps_markup(&self) -> bool {
        self.keeps_markup
    }

    /// Sets whether a generation's text keeps special tokens.
    pub fn set_keeps_markup(&mut self, keep: bool) {
        self.keeps_markup = keep;
    }

    /// Sets the BOS token (prepended when the tokenizer adds one).
    pub fn set_bos_token(&mut self, bos: Option<u32>) {
        self.bos = bos;
    }

    /// Adds tokens that end a generation (kept sorted, without repeats).
    pub fn add_stop_tokens(&mut self, ids: &[u32]) {
        self.stop_tokens.extend_from_slice(ids);
        self.stop_tokens.sort_unstable();
        self.stop_tokens.dedup();
    }

    /// Takes tokens out of those that end a generation.
    pub fn remove_stop_tokens(&mut self, ids: &[u32]) {
        self.stop_tokens.retain(|t| !ids.contains(t));
    }

    /// The tokenizer as a `tokenizer.json` document (the format safetensors
    /// models ship and [`Tokenizer::from_file`] reads).
    pub fn to_json(&self) -> Result<String> {
        self.inner.to_string(true).map_err(tok_err)
    }

    /// Token ids of `text`; special tokens written in the text (`<|im_start|>`)
    /// become their ids. With `add_bos`, prepends BOS where the model wants it.
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>> {
        let encoding = self.inner.encode_fast(text, false).map_err(tok_err)?;
        let mut ids = Vec::with_capacity(encoding.len() + 1);
        if add_bos && self.add_bos {
            ids.extend(self.bos);
        }
        ids.extend_from_slice(encoding.get_ids());
        Ok(ids)
    }

    /// Text of `ids`; special tokens are left out when `skip_special`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner.decode(ids, skip_special).map_err(tok_err)
    }

    /// The token ids that end a generation.
    pub fn stop_tokens(&self) -> &[u32] {
        &self.stop_tokens
    }

    /// The text of one token as the vocabulary spells it.
    pub fn token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of a token spelt exactly `token`.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Number of token ids, special tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The beginning-of-sequence token, if the model has one.
    pub fn bos_token(&self) -> Option<u32> {
        self.bos
    }
}
