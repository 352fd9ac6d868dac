//! Streaming detokenization: text for each new token as soon as it is whole.
//!
//! A token may end inside a UTF-8 character (byte-level BPE splits emoji and
//! CJK across tokens), and a token's text can depend on its neighbours. So the
//! last few tokens are decoded together and only text that no longer ends in
//! an incomplete character is emitted. Special tokens are left out, unless
//! the model's answers are structured by them ([`Tokenizer::keeps_markup`]).

use crate::error::Result;
use crate::tokenizer::Tokenizer;

/// Turns a stream of token ids into a stream of whole text pieces.
#[derive(Debug)]
pub struct Detokenizer {
    tokens: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl Default for Detokenizer {
    fn default() -> Self {
        Self::new()
    }
}

impl Detokenizer {
    /// An empty stream.
    pub fn new() -> Self {
        Detokenizer {
            tokens: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
        }
    }

    /// Adds a token; returns the text it completes (possibly empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, token: u32) -> Result<String> {
        self.tokens.push(token);
        let skip = !tokenizer.keeps_markup();
        let prefix = tokenizer.decode(&self.tokens[self.prefix_offset..self.read_offset], skip)?;
        let text = tokenizer.decode(&self.tokens[self.prefix_offset..], skip)?;
        if text.len() > prefix.len() && !text.ends_with('\u{FFFD}') && text.starts_with(&prefix) {
            let piece = text[prefix.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.tokens.len();
            Ok(piece)
        } else {
            Ok(String::new())
        }
    }

    /// Text held back at the end of the stream (an incomplete character is
    /// given out as the replacement character rather than lost).
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<String> {
        let skip = !tokenizer.keeps_markup();
        let prefix = tokenizer.decode(&self.tokens[self.prefix_offset..self.read_offset], skip)?;
        let text = tokenizer.decode(&self.tokens[self.prefix_offset..], skip)?;
        self.prefix_offset = self.tokens.len();
        self.read_offset = self.tokens.len();
        Ok(text.get(prefix.len()..).unwrap_or_default().to_string())
    }
}
