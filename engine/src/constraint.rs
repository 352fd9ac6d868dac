//! Constrained decoding: output that must follow a JSON Schema, any JSON
//! object, a regular expression or a Lark grammar. At each step the grammar
//! gives the set of tokens that can come next as a [`TokenMask`]; the sampler
//! picks only among them, so the output always parses.
//!
//! ```text
//!  Grammar ─► Grammars::compile (once per request; Grammars once per tokenizer)
//!          ─► Constraint: allowed() ─► TokenMask ─► Sampler::sample_within ─► token
//!                         accept(token) ◄──────────────────────────────────────┘
//!                         finished() once the grammar is complete (the answer ends)
//! ```
//!
//! The grammar engine is llguidance (the one llama.cpp and vLLM use): it
//! walks the tokenizer's vocabulary as a byte trie with an Earley parser and
//! a lazy lexer, so a mask costs well under a millisecond for JSON on a
//! 150k-token vocabulary, and it covers JSON Schema far beyond the subset
//! hand-written grammars do. The mask can be computed where the tokens are
//! known (the head stage) and applied where the logits are (the last stage):
//! [`TokenMask`] has a compact wire form.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;

/// What the output must follow.
#[derive(Debug, Clone, PartialEq)]
pub enum Grammar {
    /// Any JSON object.
    JsonObject,
    /// JSON valid against this JSON Schema.
    JsonSchema(Value),
    /// Text matching this regular expression (whole).
    Regex(String),
    /// A grammar in llguidance's Lark syntax.
    Lark(String),
}

/// How JSON output is laid out: one space after `,` and `:`, no other
/// whitespace (as Python's `json.dumps` writes it). Free whitespace would let
/// a model spend its whole token budget on newlines.
pub(crate) fn json_layout(mut schema: Value) -> Value {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
            })
        });
    }
    schema
}

impl Grammar {
    fn top_level(&self) -> TopLevelGrammar {
        match self {
            Grammar::JsonObject => TopLevelGrammar::from_json_schema(json_layout(
                serde_json::json!({"type": "object"}),
            )),
            Grammar::JsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(json_layout(schema.clone()))
            }
            Grammar::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Grammar::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        }
    }
}

/// The tokenizer's vocabulary as the grammar engine sees it: every token as
/// bytes, in a trie.
struct Vocabulary {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        // Text the grammar forces (a fixed key, say) is tokenized as the
        // model would; bytes that are not UTF-8 by the trie, greedily.
        match std::str::from_utf8(s) {
            Ok(text) => self
                .tokenizer
                .encode(text, false)
                .unwrap_or_else(|_| self.trie.greedy_tokenize(s)),
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

/// Compiles grammars for one tokenizer (built once per model: the vocabulary
/// trie takes a moment on a large vocabulary).
pub struct Grammars {
    factory: ParserFactory,
    vocab: usize,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field("vocab", &self.vocab)
            .finish()
    }
}

fn grammar_err(e: impl std::fmt::Display) -> Error {
    Error::Grammar(e.to_string())
}

impl Grammars {
    /// Reads the vocabulary of `tokenizer`; its stop tokens end a complete
    /// output.
    pub fn new(tokenizer: &Tokenizer) -> Result<Self> {
        let json: Value = serde_json::from_str(&tokenizer.to_json()?)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        // The reader asserts on vocabularies it cannot map; a model file
        // must never bring the process down.
        let words = std::panic::catch_unwind(|| llguidance::token_bytes_from_tokenizer_json(&json))
            .map_err(|_| grammar_err("the tokenizer's vocabulary cannot be read as bytes"))?
            .map_err(|e| grammar_err(format!("the tokenizer's vocabulary: {e}")))?;
        let vocab = words.len().max(tokenizer.vocab_size());
        let mut words = words;
        words.resize(vocab, Vec::new());
        let stops = tokenizer.stop_tokens();
        let Some(&eos) = stops.first() else {
            return Err(grammar_err(
                "the model has no end-of-sequence token to end a constrained answer",
            ));
        };
        let trie = TokTrie::from(&TokRxInfo::new(vocab as u32, eos), &words).with_eos_tokens(stops);
        let env: TokEnv = Arc::new(Vocabulary {
            trie,
            tokenizer: tokenizer.clone(),
        });
        let mut factory = ParserFactory::new_simple(&env).map_err(grammar_err)?;
        factory.quiet();
        Ok(Grammars { factory, vocab })
    }

    /// Compiles `grammar` into a fresh constraint; a schema or expression
    /// that is invalid, or too large, is refused with the reason.
    pub fn compile(&self, grammar: &Grammar) -> Result<Constraint> {
        let parser = self
            .factory
            .create_parser(grammar.top_level())
            .map_err(|e| Error::InvalidInput(format!("the output grammar: {e}")))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(Error::InvalidInput(format!("the output grammar: {e}")));
        }
        Ok(Constraint { matcher })
    }
}

/// One output's grammar, advanced token by token.
pub struct Constraint {
    matcher: Matcher,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("finished", &self.finished())
            .finish()
    }
}

impl Clone for Constraint {
    fn clone(&self) -> Self {
        Constraint {
            matcher: self.matcher.deep_clone(),
        }
    }
}

impl Constraint {
    /// The tokens that may come next (only the stop tokens once the grammar
    /// is complete).
    pub fn allowed(&mut self) -> Result<TokenMask> {
        let vob = self.matcher.compute_mask_or_eos().map_err(grammar_err)?;
        Ok(TokenMask::from_vob(&vob))
    }

    /// Takes the token that was sampled; a token the grammar did not allow
    /// is an error.
    pub fn accept(&mut self, token: u32) -> Result<()> {
        self.matcher.consume_token(token).map_err(grammar_err)
    }

    /// Whether the grammar is complete and allows nothing more.
    pub fn finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

/// A set of token ids: one bit per token of the vocabulary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenMask {
    words: Vec<u32>,
}

impl TokenMask {
    fn from_vob(vob: &SimpleVob) -> Self {
        let mut words = vob.as_slice().to_vec();
        words.truncate(vob.len().div_ceil(32));
        TokenMask { words }
    }

    /// A mask allowing exactly `tokens`.
    pub fn of(tokens: &[u32]) -> Self {
        let len = tokens.iter().max().map_or(0, |&m| m as usize / 32 + 1);
        let mut words = vec![0u32; len];
        for &t in tokens {
            words[t as usize / 32] |= 1 << (t % 32);
        }
        TokenMask { words }
    }

    /// Whether `token` is allowed.
    pub fn allows(&self, token: u32) -> bool {
        self.words
            .get(token as usize / 32)
            .is_some_and(|w| w & (1 << (token % 32)) != 0)
    }

    /// How many tokens are allowed.
    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// Sets the logit of every token not allowed to −∞.
    pub fn apply(&self, logits: &mut [f32]) {
        for (i, chunk) in logits.chunks_mut(32).enumerate() {
            let word = self.words.get(i).copied().unwrap_or(0);
            if word == u32::MAX {
                continue;
            }
            for (bit, l) in chunk.iter_mut().enumerate() {
                if word & (1 << bit) == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
    }

    /// The wire form: the bits, little-endian, 32 tokens per 4 bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    /// Reads the wire form; a length that is not whole words is refused.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        if !bytes.len().is_multiple_of(4) {
            return Err(Error::InvalidInput(format!(
                "a token mask of {} bytes is not whole 32-bit words",
                bytes.len()
            )));
        }
        Ok(TokenMask {
            words: bytes
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mask_round_trips_and_bans_the_rest() {
        let mask = TokenMask::of(&[0, 5, 33, 64]);
        assert_eq!(mask.count(), 4);
        assert!(mask.allows(33) && !mask.allows(34) && !mask.allows(1000));
        let back = TokenMask::from_bytes(&mask.to_bytes()).unwrap();
        assert_eq!(back, mask);
        let mut logits = vec![1.0f32; 100];
        back.apply(&mut logits);
        let kept: Vec<usize> = (0..100).filter(|&i| logits[i].is_finite()).collect();
        assert_eq!(kept, vec![0, 5, 33, 64]);
        assert!(TokenMask::from_bytes(&[1, 2, 3]).is_err());
    }
}
