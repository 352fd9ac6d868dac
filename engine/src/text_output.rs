//! From sampled tokens to the text a client sees: the generation ends on an
//! end-of-sequence token (unless ignored) or a stop string; text is released
//! only when whole (no partial character, no possible start of a stop string).
//! Shared by the in-process pipeline and by head stages serving over a network.

use crate::detokenizer::Detokenizer;
use crate::error::Result;
use crate::sampler::SamplingParams;
use crate::stop::StopMatcher;
use crate::tokenizer::Tokenizer;

/// The text of a generation, token by token.
pub struct TextOutput<'a> {
    tokenizer: &'a Tokenizer,
    ignore_eos: bool,
    detokenizer: Detokenizer,
    stops: StopMatcher,
    stopped_by_string: bool,
}

/// What one token gives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    /// Text now whole (often empty while a character or a stop string is pending).
    pub text: String,
    /// The generation ends with this token: an end-of-sequence token (which
    /// gives no text) or a stop string (left out of the text).
    pub stop: bool,
}

impl<'a> TextOutput<'a> {
    /// Text for a generation sampled with `params`.
    pub fn new(tokenizer: &'a Tokenizer, params: &SamplingParams) -> Self {
        TextOutput {
            tokenizer,
            ignore_eos: params.ignore_eos,
            detokenizer: Detokenizer::new(),
            stops: StopMatcher::new(&params.stop),
            stopped_by_string: false,
        }
    }

    /// Takes the next sampled token.
    pub fn push(&mut self, token: u32) -> Result<Piece> {
        if !self.ignore_eos && self.tokenizer.stop_tokens().contains(&token) {
            return Ok(Piece {
                text: String::new(),
                stop: true,
            });
        }
        let released = self
            .stops
            .push(&self.detokenizer.push(self.tokenizer, token)?);
        self.stopped_by_string = released.stopped;
        Ok(Piece {
            text: released.text,
            stop: released.stopped,
        })
    }

    /// The text still held back when the generation ends (none after a stop
    /// string).
    pub fn finish(mut self) -> Result<String> {
        if self.stopped_by_string {
            return Ok(String::new());
        }
        let rest = self.stops.push(&self.detokenizer.finish(self.tokenizer)?);
        Ok(if rest.stopped {
            rest.text
        } else {
            rest.text + &self.stops.finish()
        })
    }
}
