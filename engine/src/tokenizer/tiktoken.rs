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

use std::collections::{BTreeMap, HashMap, HashSet};

use base64::Engine as _;
use serde_json::Value;
use tokenizers::AddedToken;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;

use super::{pre_tokenizer, pre_type, tok_err};
use crate::error::{Error, Result};

/// Special tokens the tokenizers' code puts after the ranks.
const RESERVED_SPECIALS: u32 = 256;
/// The most ranks read (Kimi K2 has 163,584).
const MOST_RANKS: usize = 1 << 21;
/// The longest token read, in bytes.
const LONGEST_TOKEN: usize = 1024;
/// The most work finding merges may take: the sum over tokens of their
/// length squared (each cut of a token looks up its two halves). Real
/// files take a few percent of it; a file of long tokens made to cost
/// more is refused.
const MOST_MERGE_WORK: u64 = 1 << 30;

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
/// once, each token distinct, every single byte a token (else text holding
/// it would be lost), within the bounds above.
fn ranks(text: &str, file: &str) -> Result<Vec<Vec<u8>>> {
    let corrupt = |reason: String| Error::CorruptModel {
        path: file.into(),
        reason,
    };
    let mut by_rank: BTreeMap<u32, Vec<u8>> = BTreeMap::new();
    let mut work = 0u64;
    let lines = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty());
    for (n, line) in lines {
        let at = |what: String| corrupt(format!("line {}: {what}", n + 1));
        if by_rank.len() == MOST_RANKS {
            return Err(at(format!("more than {MOST_RANKS} ranks")));
        }
        let (token, rank) = line
            .split_once(' ')
            .ok_or_else(|| at("not \"<base64> <rank>\"".into()))?;
        if token.len() > LONGEST_TOKEN.div_ceil(3) * 4 {
            return Err(at(format!("a token longer than {LONGEST_TOKEN} bytes")));
        }
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(token)
            .map_err(|e| at(e.to_string()))?;
        let rank: u32 = rank
            .trim()
            .parse()
            .map_err(|e| at(format!("rank {rank:?}: {e}")))?;
        if bytes.is_empty() || bytes.len() > LONGEST_TOKEN {
            return Err(at(format!("a token of {} bytes", bytes.len())));
        }
        work += (bytes.len() as u64).pow(2);
        if work > MOST_MERGE_WORK {
            return Err(at(
                "the tokens are too long in all to find their merges".into()
            ));
        }
        if by_rank.insert(rank, bytes).is_some() {
            return Err(at(format!("rank {rank} is given twice")));
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
    let ranks: Vec<Vec<u8>> = by_rank.into_values().collect();
    let mut seen = HashSet::with_capacity(ranks.len());
    if let Some(rank) = ranks.iter().position(|t| !seen.insert(t.as_slice())) {
        return Err(corrupt(format!(
            "rank {rank}'s token is an earlier rank's too"
        )));
    }
    if let Some(byte) = (0..=255u8).find(|b| !seen.contains(&[*b][..])) {
        return Err(corrupt(format!(
            "byte {byte:#04x} is no token, so text holding it could not be tokenized"
        )));
    }
    Ok(ranks)
}

/// The module of the tokenizer's code `tokenizer_config.json` names in
/// `auto_map` (`module.Class`, or `owner/repo--module.Class` for code kept
/// in another repository).
fn code_module(config: &Value) -> Option<&str> {
    let auto = config.get("auto_map")?.get("AutoTokenizer")?;
    let class = match auto {
        Value::Array(names) => names.first()?.as_str()?,
        other => other.as_str()?,
    };
    let class = class.rsplit_once("--").map_or(class, |(_, local)| local);
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
    let known = || {
        let codes: Vec<&str> = CODES.iter().map(|(code, _)| *code).collect();
        codes.join(", ")
    };
    let Some(module) = code_module(config) else {
        return Err(Error::Tokenizer(format!(
            "a tiktoken tokenizer's splits are defined by its code, and its \
             tokenizer_config.json names none (auto_map.AutoTokenizer); supported: {}",
            known()
        )));
    };
    let pre = CODES
        .iter()
        .find(|(code, _)| *code == module)
        .map(|(_, pre)| pre_type(pre))
        .transpose()?
        .ok_or_else(|| {
            Error::Tokenizer(format!(
                "a tiktoken tokenizer's splits are defined by its code; {module:?} is not \
                 supported (supported: {})",
                known()
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
    // At most MOST_RANKS: the special ids after them fit in a u32.
    let specials = specials(config, ranks.len() as u32, file)?;
    for (id, content) in &specials {
        if let Some(other) = vocab.insert(content.clone(), *id) {
            return Err(Error::CorruptModel {
                path: file.into(),
                reason: format!("special token {content:?} ({id}) is spelled as token {other} is"),
            });
        }
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
/// names of the rest of the 256 after the `count` ranks (the only ids the
/// tokenizers' code gives special tokens: another is refused).
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
        if !(count..count + RESERVED_SPECIALS).contains(&id) {
            return Err(Error::CorruptModel {
                path: file.into(),
                reason: format!(
                    "added token {content:?} takes id {id}, not one of the {RESERVED_SPECIALS} \
                     special ids after the {count} ranks"
                ),
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

    /// A `tiktoken.model` of every byte, then `more` tokens.
    fn model(more: &[&[u8]]) -> String {
        let b64 = |t: &[u8]| base64::engine::general_purpose::STANDARD.encode(t);
        let bytes: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        let tokens = bytes.iter().map(Vec::as_slice).chain(more.iter().copied());
        tokens
            .enumerate()
            .map(|(rank, t)| format!("{} {rank}\n", b64(t)))
            .collect()
    }

    fn kimi() -> Value {
        serde_json::json!({"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", null]}})
    }

    fn refusal(text: &str, config: &Value) -> String {
        tiktoken_bpe(text, "tiktoken.model", config)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn bad_ranks_are_refused_by_what_is_wrong() {
        let long = vec![b'a'; LONGEST_TOKEN + 1];
        let longer = vec![b'a'; 2 * LONGEST_TOKEN];
        // Four letters' runs of every length: each token fine, all too many.
        let repeated: Vec<Vec<u8>> = (b'b'..=b'e')
            .flat_map(|c| (2..=LONGEST_TOKEN).map(move |n| vec![c; n]))
            .collect();
        let repeated: Vec<&[u8]> = repeated.iter().map(Vec::as_slice).collect();
        for (text, says) in [
            ("YQ== 0\nYg== 2\n".to_string(), "not 0 to 1".to_string()),
            ("YQ== 0\nYQ== 0\n".into(), "given twice".into()),
            ("YQ==\n".into(), "line 1".into()),
            ("!!! 0\n".into(), "line 1".into()),
            ("YQ== 0\n".into(), "byte 0x00 is no token".into()),
            (
                model(&[b"a"]),
                "rank 256's token is an earlier rank's too".into(),
            ),
            (
                model(&[&long]),
                format!("a token of {} bytes", LONGEST_TOKEN + 1),
            ),
            (
                model(&[&longer]),
                format!("a token longer than {LONGEST_TOKEN} bytes"),
            ),
            (model(&repeated), "too long in all".into()),
        ] {
            let err = refusal(&text, &kimi());
            assert!(err.contains(&says), "{says}: {err}");
        }
        // Whole and readable: the merges are found.
        let tokenizer = tiktoken_bpe(&model(&[b"ab", b"abc"]), "tiktoken.model", &kimi()).unwrap();
        let ids = tokenizer
            .encode("abc abd", false)
            .unwrap()
            .get_ids()
            .to_vec();
        assert_eq!(ids, [257, 32, 256, 100]);
    }

    #[test]
    fn the_code_and_the_special_tokens_are_checked() {
        let text = model(&[]);
        let other = serde_json::json!({"auto_map": {"AutoTokenizer": "tokenization_other.T"}});
        let err = refusal(&text, &other);
        assert!(
            err.contains("\"tokenization_other\"") && err.contains("tokenization_kimi"),
            "{err}"
        );
        let err = refusal(&text, &serde_json::json!({}));
        assert!(err.contains("names none"), "{err}");
        // Code kept in another repository is named with it.
        let elsewhere = serde_json::json!({"auto_map": {"AutoTokenizer": ["org/kimi--tokenization_kimi.TikTokenTokenizer"]}});
        assert!(tiktoken_bpe(&text, "tiktoken.model", &elsewhere).is_ok());
        let with = |id: &str, content: &str| {
            let mut config = kimi();
            config["added_tokens_decoder"] =
                serde_json::json!({id: {"content": content, "special": true}});
            config
        };
        for (config, says) in [
            (
                with("0", "[BOS]"),
                "not one of the 256 special ids after the 256 ranks",
            ),
            (with("512", "[BOS]"), "takes id 512"),
            (with("4000000000", "[BOS]"), "takes id 4000000000"),
            (with("256", "a"), "spelled as token 97 is"),
            (with("x", "[BOS]"), "no number"),
        ] {
            let err = refusal(&text, &config);
            assert!(err.contains(says), "{says}: {err}");
        }
        let tokenizer = tiktoken_bpe(&text, "tiktoken.model", &with("257", "[EOS]")).unwrap();
        assert_eq!(tokenizer.token_to_id("[EOS]"), Some(257));
        assert_eq!(tokenizer.token_to_id("<|reserved_token_256|>"), Some(256));
        assert_eq!(tokenizer.token_to_id("<|reserved_token_511|>"), Some(511));
        assert_eq!(tokenizer.get_vocab_size(true), 512);
    }
}
