//! The readers of model files an operator or agent may be handed by a
//! stranger (a Model's URL or repository), fed arbitrary bytes: a GGUF
//! header, the configuration read from it, a Hugging Face `config.json` and
//! a safetensors header never panic, never loop and never allocate more
//! than the input justifies; every tensor the GGUF reader accepts has a
//! place in the file that does not overflow.
//!
//! ```text
//!  byte 0 % 3 ─┬─ 0: the rest as a GGUF file
//!              ├─ 1: the rest as edits (offset, byte) of a small valid llama GGUF
//!              └─ 2: the rest as a safetensors file and as config.json
//! ```
//! Edits reach deep into a valid file, where random bytes rarely get.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use shardplane_formats::config::ModelConfig;
use shardplane_formats::ggml::GgmlType;
use shardplane_formats::gguf::write::{Tensor, file};
use shardplane_formats::gguf::{Array, GgufHeader, Value};
use shardplane_formats::safetensors;

/// A small llama GGUF: every key `ModelConfig::from_gguf` reads, two tensors.
fn template() -> &'static [u8] {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BYTES.get_or_init(|| {
        let u = |k: &'static str, v: u32| (k, Value::U32(v));
        file(
            &[
                ("general.architecture", Value::String("llama".into())),
                u("llama.block_count", 2),
                u("llama.embedding_length", 8),
                u("llama.feed_forward_length", 16),
                u("llama.attention.head_count", 2),
                u("llama.attention.head_count_kv", 1),
                u("llama.context_length", 64),
                ("llama.rope.freq_base", Value::F32(10_000.0)),
                (
                    "tokenizer.ggml.tokens",
                    Value::Array(Array::String(vec!["a".into(), "b".into(), "c".into()])),
                ),
            ],
            &[
                Tensor {
                    name: "token_embd.weight".into(),
                    dims: vec![8, 3],
                    dtype: GgmlType::F32,
                    data: vec![0; 96],
                },
                Tensor {
                    name: "blk.0.attn_norm.weight".into(),
                    dims: vec![8],
                    dtype: GgmlType::F32,
                    data: vec![0; 32],
                },
            ],
        )
    })
}

fn gguf(bytes: &[u8]) {
    let Ok(header) = GgufHeader::read(bytes) else {
        return;
    };
    for (name, t) in &header.tensors {
        if let Ok((start, len)) = header.tensor_range(name) {
            assert!(start.checked_add(len).is_some(), "{name}: {t:?}");
        }
        let _ = header.tensor_bytes(name);
    }
    let _ = ModelConfig::from_gguf(&header);
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    match mode % 3 {
        0 => gguf(rest),
        1 => {
            let mut bytes = template().to_vec();
            for edit in rest.chunks_exact(3) {
                let at = u16::from_le_bytes([edit[0], edit[1]]) as usize;
                if let Some(b) = bytes.get_mut(at % template().len()) {
                    *b = edit[2];
                }
            }
            // A trailing odd byte cuts the file short.
            if rest.len() % 3 == 1 {
                bytes.truncate(rest[rest.len() - 1] as usize * bytes.len() / 256);
            }
            gguf(&bytes);
        }
        _ => {
            let _ = safetensors::parse_header(rest);
            if let Ok(v) = serde_json::from_slice::<serde_json::Value>(rest) {
                let _ = ModelConfig::from_hf_json(&v);
            }
        }
    }
});
