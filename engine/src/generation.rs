//! The one generation loop, shared by the in-process pipeline (the CLI) and
//! by head stages serving over the network: a request checked once into a
//! [`ValidRequest`], then a [`Decoder`] that says what to run through the
//! model next and turns the tokens that come back into text, until an
//! end-of-sequence token, a stop string or the token limit.
//!
//! ```text
//!  prompt, resume, params ─► ValidRequest::new (the same rules wherever a request enters)
//!  Decoder::new: the resumed tokens replayed (their text was given before)
//!    loop: next_input() ─► model: local stages, or the pipeline over gRPC ─► sampled token
//!          accept(token) ─► text now whole (held back: partial characters, possible stop strings)
//!  finish() ─► the text still held back, and why it ended
//! ```
//!
//! Sampling stays with the caller: on one machine it samples the logits, on
//! a pipeline the last stage does. An output grammar stays here: the
//! decoder says which tokens the next sample may choose ([`Decoder::allowed`])
//! and ends the answer once the grammar is complete.

use crate::constraint::{Constraint, TokenMask};
use crate::error::{Error, Result};
use crate::sampler::SamplingParams;
use crate::text_output::{Piece, TextOutput};
use crate::tokenizer::Tokenizer;

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` or the context length was reached.
    Length,
}

/// A generation request checked against the model it runs on: everything
/// behind it trusts it.
#[derive(Debug, Clone)]
pub struct ValidRequest {
    prompt: Vec<u32>,
    resume: Vec<u32>,
    params: SamplingParams,
    constraint: Option<Constraint>,
}

impl ValidRequest {
    /// Checks a request for a model of `vocab` tokens loaded for `context`
    /// tokens: a prompt that is not empty and leaves room for a reply, token
    /// ids inside the vocabulary, valid sampling parameters, and no more
    /// tokens to resume from (the answer given before an interruption) than
    /// the answer may have. `max_tokens` is cut to the room the context
    /// leaves.
    pub fn new(
        prompt: Vec<u32>,
        resume: Vec<u32>,
        mut params: SamplingParams,
        vocab: usize,
        context: usize,
    ) -> Result<Self> {
        if prompt.is_empty() {
            return Err(Error::InvalidInput("the prompt is empty".into()));
        }
        if let Some(bad) = prompt
            .iter()
            .chain(&resume)
            .find(|&&id| id as usize >= vocab)
        {
            return Err(Error::InvalidInput(format!(
                "token {bad} is past the vocabulary of {vocab}"
            )));
        }
        if prompt.len() >= context {
            return Err(Error::ContextOverflow {
                needed: prompt.len() + 1,
                context,
            });
        }
        params.max_tokens = params.max_tokens.min(context - prompt.len());
        params.validate()?;
        if resume.len() > params.max_tokens {
            return Err(Error::InvalidInput(format!(
                "{} tokens to resume from; this answer may have at most {}",
                resume.len(),
                params.max_tokens
            )));
        }
        Ok(ValidRequest {
            prompt,
            resume,
            params,
            constraint: None,
        })
    }

    /// Adds an output grammar the answer must follow (compiled with
    /// [`crate::constraint::Grammars`]). It cannot go with `ignore_eos`: a
    /// complete output must be able to end.
    pub fn with_constraint(mut self, constraint: Constraint) -> Result<Self> {
        if self.params.ignore_eos {
            return Err(Error::InvalidInput(
                "an output grammar cannot go with ignore_eos: a complete output must end".into(),
            ));
        }
        self.constraint = Some(constraint);
        Ok(self)
    }

    /// Whether the answer must follow a grammar.
    pub fn is_constrained(&self) -> bool {
        self.constraint.is_some()
    }

    /// The prompt's tokens.
    pub fn prompt(&self) -> &[u32] {
        &self.prompt
    }

    /// The tokens of the answer given before, resumed from.
    pub fn resumed(&self) -> &[u32] {
        &self.resume
    }

    /// The sampling parameters, `max_tokens` within the context.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The prompt, then the tokens resumed from: what the model reads first
    /// (and what repetition penalties see).
    pub fn context(&self) -> Vec<u32> {
        [self.prompt.as_slice(), &self.resume].concat()
    }
}

/// A generation under way, from tokens to text.
pub struct Decoder<'a> {
    output: TextOutput<'a>,
    max_tokens: usize,
    generated: usize,
    next: Option<Vec<u32>>,
    finish: FinishReason,
    constraint: Option<Constraint>,
    replayed: String,
}

impl<'a> Decoder<'a> {
    /// Starts `request`. The tokens it resumes from are replayed first: the
    /// text they released was given then; what they hold back comes with the
    /// next token. Resumed tokens that end the answer before their last are
    /// refused.
    pub fn new(tokenizer: &'a Tokenizer, request: &ValidRequest) -> Result<Self> {
        let mut output = TextOutput::new(tokenizer, &request.params);
        let mut finish = FinishReason::Length;
        let mut constraint = request.constraint.clone();
        let mut replayed = String::new();
        let resume = &request.resume;
        for (i, &token) in resume.iter().enumerate() {
            let piece = output.push(token)?;
            replayed.push_str(&piece.text);
            let mut stop = piece.stop;
            if !stop && let Some(c) = &mut constraint {
                c.accept(token).map_err(|e| {
                    Error::InvalidInput(format!(
                        "token {i} to resume from does not follow the output grammar: {e}"
                    ))
                })?;
                stop = c.finished();
            }
            if stop {
                if i + 1 < resume.len() {
                    return Err(Error::InvalidInput(format!(
                        "the tokens to resume from end the answer at token {i} of {}",
                        resume.len()
                    )));
                }
                finish = FinishReason::Stop;
            }
        }
        let max_tokens = request.params.max_tokens;
        let done = finish == FinishReason::Stop || resume.len() >= max_tokens;
        Ok(Decoder {
            output,
            max_tokens,
            generated: resume.len(),
            next: (!done).then(|| request.context()),
            finish,
            constraint,
            replayed,
        })
    }

    /// The text the resumed tokens released (given before the interruption).
    pub fn replayed(&self) -> &str {
        &self.replayed
    }

    /// The tokens the next sample may choose from, when the answer follows
    /// a grammar: computed after [`Decoder::next_input`] and before the
    /// token comes back.
    pub fn allowed(&mut self) -> Result<Option<TokenMask>> {
        self.constraint
            .as_mut()
            .map(Constraint::allowed)
            .transpose()
    }

    /// The tokens to run through the model next (the prompt and resumed
    /// tokens, then each new token), or `None` once the answer has ended.
    pub fn next_input(&mut self) -> Option<Vec<u32>> {
        self.next.take()
    }

    /// Takes the token sampled after the last input: the text it makes
    /// whole, and whether the answer ends with it.
    pub fn accept(&mut self, token: u32) -> Result<Piece> {
        self.generated += 1;
        let piece = self.output.push(token)?;
        let mut stop = piece.stop;
        if !stop && let Some(c) = &mut self.constraint {
            c.accept(token)?;
            stop = c.finished();
        }
        if stop {
            self.finish = FinishReason::Stop;
        } else if self.generated < self.max_tokens {
            self.next = Some(vec![token]);
        }
        Ok(piece)
    }

    /// Tokens of the answer so far, resumed ones included.
    pub fn generated(&self) -> usize {
        self.generated
    }

    /// Ends the answer: the text still held back, and why it ended.
    pub fn finish(self) -> Result<(String, FinishReason)> {
        Ok((self.output.finish()?, self.finish))
    }
}
