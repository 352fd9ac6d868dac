//! Tokenizers kept as tiktoken BPE ranks (`tiktoken.model`, as Kimi K2's
//! repositories keep theirs), built as the byte-level BPE the rest of the
//! engine runs, tokenizing as tiktoken does.
//!
//! ```text
//!  tiktoken.model: "<base64 bytes> <rank>" per line
//!    ├─► vocabulary: each token's bytes as GPT-2's visible characters, id = rank
//!    └─► merges: every split of a token into two tokens, ordered by its rank
//!  tokenizer_config.json
//!    ├─ auto_map: the tokenizer's code, which defines its splits ─► the family's splits
//!    └─ added_tokens_decoder ─► special tokens after the ranks (256 of them:
//!                                the unnamed ones reserved, as its code names them)
//! ```
//!
//! tiktoken merges, in each piece its splits cut, the adjacent pair whose
//! joined bytes have the lowest rank, and takes a piece that is a token
//! whole; a BPE whose merges are ordered by the joined token's rank, with
//! `ignore_merges`, does the same.

use std::collections::{BTreeMap, HashMap};

use base64::Engine as _;
use serde_json::Value;
use tokenizers::AddedToken;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;

use super::{pre_tokenizer, pre_type, tok_err};
use crate::error::{Error, Result};

/// Special tokens the tokenizers' code puts after the ranks.
const RESERVED_SPECIALS: u32 = 256;

/// The tokenizers' code modules (in `auto_map`) read, with the GGUF
/// pre-tokenizer type that splits as they do.
const CODES: &[(&str, &str)] = &[("tokenization_kimi", "kimi-k2")];

/// GPT-2's map of bytes to visible characters: printable Latin-1 bytes stand
/// for themselves, the others for the characters from U+0100 on, in order.
fn byte_chars() -> [char; 256] {
    let mut chars = ['\0'; 256];
    let mut next = 256u32;
    for (b, slot) in chars.iter_mut().enumerate() {
        let visible = matches!(b, 0x21..=0x7e | 0xa1..=0xac | 0xae..=0xff);
        *slot = match visible {
            true => char::from(b as u8),
            false => {
                next += 1;
                char::from_u32(next - 1).expect("below the surrogates")
            }
        };
    }
    chars
}

/// The ranks of `text` (a `tiktoken.model`), by id: every id from 0 up, each
/// once, each token distinct.
fn ranks(text: &str, file: &str) -> Result<Vec<Vec<u8>>> {
    let corrupt = |reason: String| Error::CorruptModel {
        path: file.into(),
        reason,
    };
    let mut by_rank: BTreeMap<u32, Vec<u8>> = BTreeMap::new();
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let (token, rank) = line
            .split_once(' ')
            .ok_or_else(|| corrupt(format!("line {}: not \"<base64> <rank>\"", n + 1)))?;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(token)
            .map_err(|e| corrupt(format!("line {}: {e}", n + 1)))?;
        let rank: u32 = rank
            .trim()
            .parse()
            .map_err(|e| corrupt(format!("line {}: rank {rank:?}: {e}", n + 1)))?;
        if bytes.is_empty() || by_rank.insert(rank, bytes).is_some() {
            return Err(corrupt(format!(
                "line {}: rank {rank} is empty or given twice",
                n + 1
            )));
        }
    }
    let count = by_rank.len();
    if by_rank
        .keys()
        .next_back()
        .is_some_and(|&last| last as usize + 1 != count)
    {
        return Err(corrupt(format!(
            "{count} ranks that are not 0 to {}",
            count.saturating_sub(1)
        )));
    }
    Ok(by_rank.into_values().collect())
}

/// The module of the tokenizer's code `tokenizer_config.json` names.
fn code_module(config: &Value) -> Option<&str> {
    let auto = config.get("auto_map")?.get("AutoTokenizer")?;
    let class = match auto {
        Value::Array(names) => names.first()?.as_str()?,
        other => other.as_str()?,
    };
    class.rsplit_once('.').map(|(module, _)| module)
}

/// The byte-level BPE of `ranks_text` (a `tiktoken.model` at `file`) and
/// the special tokens after its ranks, split as the code that
/// `tokenizer_config.json` (`config`) names does.
pub(super) fn tiktoken_bpe(
    ranks_text: &str,
    file: &str,
    config: &Value,
) -> Result<tokenizers::Tokenizer> {
    let module = code_module(config).unwrap_or("(none named in auto_map)");
    let pre = CODES
        .iter()
        .find(|(code, _)| *code == module)
        .map(|(_, pre)| pre_type(pre))
        .transpose()?
        .ok_or_else(|| {
            let known: Vec<&str> = CODES.iter().map(|(code, _)| *code).collect();
            Error::Tokenizer(format!(
                "a tiktoken tokenizer's splits are defined by its code; {module:?} is not \
                 supported (supported: {})",
                known.join(", ")
            ))
        })?;
    let ranks = ranks(ranks_text, file)?;
    let chars = byte_chars();
    let visible = |bytes: &[u8]| -> String { bytes.iter().map(|&b| chars[b as usize]).collect() };
    let ids: HashMap<&[u8], u32> = ranks
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_slice(), i as u32))
        .collect();
    // Every split of a token into two tokens merges into it, with its rank:
    // by the joined token's rank, then the halves' ranks.
    let mut merges: Vec<(u32, u32, u32)> = Vec::new();
    for (rank, token) in ranks.iter().enumerate() {
        for cut in 1..token.len() {
            if let (Some(&l), Some(&r)) = (ids.get(&token[..cut]), ids.get(&token[cut..])) {
                merges.push((rank as u32, l, r));
            }
        }
    }
    merges.sort_unstable();
    let mut vocab: tokenizers::models::bpe::Vocab = ranks
        .iter()
        .enumerate()
        .map(|(i, t)| (visible(t), i as u32))
        .collect();
    let specials = specials(config, ranks.len() as u32, file)?;
    for (id, content) in &specials {
        vocab.insert(content.clone(), *id);
    }
    let merges = merges
        .into_iter()
        .map(|(_, l, r)| (visible(&ranks[l as usize]), visible(&ranks[r as usize])))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(true)
        .build()
        .map_err(tok_err)?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    inner.with_pre_tokenizer(Some(pre_tokenizer(pre)?));
    inner.with_decoder(Some(ByteLevelDecoder::default()));
    let added: Vec<AddedToken> = specials
        .into_values()
        .map(|content| AddedToken::from(content, true))
        .collect();
    inner.add_special_tokens(&added);
    Ok(inner)
}

/// The special tokens, by id: `added_tokens_decoder`'s, and the reserved
/// names of the rest of the 256 after the `count` ranks.
fn specials(config: &Value, count: u32, file: &str) -> Result<BTreeMap<u32, String>> {
    let mut specials: BTreeMap<u32, String> = (count..count + RESERVED_SPECIALS)
        .map(|id| (id, format!("<|reserved_token_{id}|>")))
        .collect();
    let named = config
        .get("added_tokens_decoder")
        .and_then(Value::as_object)
        .into_iter()
        .flatten();
    for (id, token) in named {
        let content = token.get("content").and_then(Value::as_str);
        let (Ok(id), Some(content)) = (id.parse::<u32>(), content) else {
            return Err(Error::CorruptModel {
                path: file.into(),
                reason: format!("added token {id:?} has no number or no content"),
            });
        };
        if id < count {
            return Err(Error::CorruptModel {
                path: file.into(),
                reason: format!("added token {content:?} takes id {id}, a rank's"),
            });
        }
        specials.insert(id, content.to_string());
    }
    Ok(specials)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_map_to_gpt2_s_visible_characters() {
        let chars = byte_chars();
        assert_eq!(chars[b'a' as usize], 'a');
        assert_eq!(chars[b' ' as usize], 'Ġ');
        assert_eq!(chars[b'\n' as usize], 'Ċ');
        assert_eq!(chars[0xad], 'Ń');
        let distinct: std::collections::HashSet<char> = chars.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
    }

    #[test]
    fn bad_ranks_and_codes_are_named() {
        let kimi = serde_json::json!({"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", null]}});
        for (text, says) in [
            ("YQ== 0\nYg== 2\n", "not 0 to 1"),
            ("YQ== 0\nYQ== 0\n", "given twice"),
            ("YQ==\n", "line 1"),
            ("!!! 0\n", "line 1"),
        ] {
            let err = tiktoken_bpe(text, "tiktoken.model", &kimi)
                .unwrap_err()
                .to_string();
            assert!(err.contains(says), "{text:?}: {err}");
        }
        let other = serde_json::json!({"auto_map": {"AutoTokenizer": "tokenization_other.T"}});
        let err = tiktoken_bpe("YQ== 0\n", "tiktoken.model", &other)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"tokenization_other\"") && err.contains("tokenization_kimi"),
            "{err}"
        );
        let clash = serde_json::json!({
            "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer"]},
            "added_tokens_decoder": {"0": {"content": "[BOS]", "special": true}},
        });
        let err = tiktoken_bpe("YQ== 0\n", "tiktoken.model", &clash)
            .unwrap_err()
            .to_string();
        assert!(err.contains("a rank's"), "{err}");
    }
}
