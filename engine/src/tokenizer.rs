//! Tokenizers built from a model's own files, with the `tokenizers` crate:
//! from GGUF metadata (BPE vocabulary, merges and the pre-tokenizer the file
//! names) or from a `tokenizer.json`.

use std::path::Path;

use shardplane_formats::gguf::{Array, GgufHeader};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use crate::error::{Error, Result};

/// GPT-2's split, also what `ByteLevel` applies with `use_regex`; listed for the
/// pre-tokenizer types that add a split before it.
const GPT2_SPLIT: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Llama 3's split (numbers in groups of up to three).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split (every digit alone).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GGUF token types that are control or user-defined tokens, matched whole in text.
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// A tokenizer and the model's special tokens.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos: Option<u32>,
    add_bos: bool,
    stop_tokens: Vec<u32>,
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

/// The pre-tokenizer for a GGUF `tokenizer.ggml.pre` value.
fn pre_tokenizer(pre: &str) -> Result<PreTokenizerWrapper> {
    let byte_level = |use_regex| PreTokenizerWrapper::from(ByteLevel::new(false, true, use_regex));
    Ok(match pre {
        "llama-bpe" | "llama3" | "dbrx" | "smaug-bpe" | "falcon3" => {
            Sequence::new(vec![split(LLAMA3_SPLIT)?, byte_level(false)]).into()
        }
        "qwen2" | "deepseek-r1-qwen" | "megrez" => {
            Sequence::new(vec![split(QWEN2_SPLIT)?, byte_level(false)]).into()
        }
        // Every number character alone, then GPT-2's split.
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva" => {
            Sequence::new(vec![
                split(r"\p{N}")?,
                split(GPT2_SPLIT)?,
                byte_level(false),
            ])
            .into()
        }
        "gpt-2" | "default" | "phi-2" | "jais" => byte_level(true),
        other => {
            tracing::warn!(
                pre = other,
                "unknown GGUF pre-tokenizer type; splitting as GPT-2 does"
            );
            byte_level(true)
        }
    })
}

impl Tokenizer {
    /// Builds the tokenizer a GGUF file describes.
    pub fn from_gguf(header: &GgufHeader) -> Result<Self> {
        let model = header.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(Error::Tokenizer(format!(
                "tokenizer model {model:?} is not supported: supported is the BPE model GGUF calls gpt2 (SmolLM, Llama 3, Qwen)"
            )));
        }
        let tokens = header.get_strings("tokenizer.ggml.tokens")?;
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
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(tok_err)?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        let pre = header.get_str("tokenizer.ggml.pre").unwrap_or("default");
        inner.with_pre_tokenizer(Some(pre_tokenizer(pre)?));
        inner.with_decoder(Some(ByteLevelDecoder::default()));

        let types: Vec<i64> = header
            .get("tokenizer.ggml.token_type")
            .ok()
            .and_then(|v| v.as_array())
            .and_then(Array::to_i64s)
            .unwrap_or_default();
        let specials: Vec<AddedToken> = types
            .iter()
            .enumerate()
            .filter(|(_, t)| matches!(**t, TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED))
            .filter_map(|(i, _)| tokens.get(i))
            .map(|t| AddedToken::from(t.to_string(), true))
            .collect();
        inner.add_special_tokens(&specials);

        let bos = header.get_u32("tokenizer.ggml.bos_token_id").ok();
        let add_bos = header
            .get("tokenizer.ggml.add_bos_token")
            .is_ok_and(|v| v.as_bool() == Some(true));
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
        })
    }

    /// Loads a `tokenizer.json` (safetensors models); stop tokens come from the
    /// model's `eos_token_id`.
    pub fn from_file(
        path: impl AsRef<Path>,
        eos_token_ids: &[u32],
        bos: Option<u32>,
    ) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(path.as_ref()).map_err(tok_err)?;
        Ok(Tokenizer {
            inner,
            bos,
            add_bos: false,
            stop_tokens: eos_token_ids.to_vec(),
        })
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
