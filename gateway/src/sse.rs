//! Server-sent events of an OpenAI-compatible stream (chat or text
//! completions), decoded into this gateway's events. Pure and synchronous:
//! bytes go in as they arrive, however they are split, and events come out;
//! the external fallback (`external`) feeds it from the HTTP body, the fuzz
//! target `sse_events` from arbitrary bytes.
//!
//! ```text
//!  bytes ──push──► lines ("data: {json}") ──next──► Text… then Done, or one Err
//! ```
//!
//! A line longer than [`MAX_LINE`] ends the stream with an error (the buffer
//! never grows without bound); an `error` object mid-stream ends it with an
//! error, never a normal finish; after `Done` or an error nothing follows.

use serde_json::Value;

use crate::protocol::{ApiError, Event, Finish};

/// The longest line (one event's data) the decoder holds.
pub const MAX_LINE: usize = 4 << 20;

/// Decodes one stream.
#[derive(Debug)]
pub struct SseDecoder {
    chat: bool,
    buffer: Vec<u8>,
    /// Where the search for the next newline resumes.
    scanned: usize,
    finish: Option<Finish>,
    usage: Option<(u32, u32)>,
    pieces: u32,
    ended: bool,
}

impl SseDecoder {
    /// A decoder for a chat (`delta.content`) or text (`text`) stream.
    pub fn new(chat: bool) -> Self {
        Self {
            chat,
            buffer: Vec::new(),
            scanned: 0,
            finish: None,
            usage: None,
            pieces: 0,
            ended: false,
        }
    }

    /// Whether the stream has ended (`Done` or an error was returned).
    pub fn ended(&self) -> bool {
        self.ended
    }

    /// Adds bytes as they arrived.
    pub fn push(&mut self, bytes: &[u8]) {
        if !self.ended {
            self.buffer.extend_from_slice(bytes);
        }
    }

    /// The next event from the bytes pushed so far; `None` when more bytes
    /// are needed or the stream has ended.
    pub fn next_event(&mut self) -> Option<Result<Event, ApiError>> {
        while !self.ended {
            let Some(offset) = self.buffer[self.scanned..].iter().position(|b| *b == b'\n') else {
                self.scanned = self.buffer.len();
                if self.buffer.len() > MAX_LINE {
                    return Some(self.fail(format!(
                        "the external endpoint sent a line longer than {MAX_LINE} bytes"
                    )));
                }
                return None;
            };
            let end = self.scanned + offset;
            if end > MAX_LINE {
                return Some(self.fail(format!(
                    "the external endpoint sent a line longer than {MAX_LINE} bytes"
                )));
            }
            let line: Vec<u8> = self.buffer.drain(..=end).collect();
            self.scanned = 0;
            if let Some(event) = self.line(&line) {
                return Some(event);
            }
        }
        None
    }

    /// The end of the body: an error unless the stream said it was done.
    pub fn finish(&mut self) -> Option<Result<Event, ApiError>> {
        (!self.ended).then(|| self.fail("the external endpoint ended its stream early".into()))
    }

    fn fail(&mut self, message: String) -> Result<Event, ApiError> {
        self.ended = true;
        self.buffer = Vec::new();
        Err(ApiError::upstream(message))
    }

    /// The event one line makes, if any.
    fn line(&mut self, line: &[u8]) -> Option<Result<Event, ApiError>> {
        let line = String::from_utf8_lossy(line);
        let data = line.trim().strip_prefix("data:")?.trim();
        if data == "[DONE]" {
            self.ended = true;
            self.buffer = Vec::new();
            let (prompt_tokens, completion_tokens) = self.usage.unwrap_or((0, self.pieces));
            return Some(Ok(Event::Done {
                finish: self.finish.unwrap_or(Finish::Stop),
                prompt_tokens,
                completion_tokens,
                cached_tokens: 0,
            }));
        }
        let v = serde_json::from_str::<Value>(data).ok()?;
        // The endpoint failed mid-answer (OpenAI's and vLLM's shape).
        if let Some(error) = v.get("error").filter(|e| !e.is_null()) {
            let message = error["message"]
                .as_str()
                .map_or_else(|| error.to_string(), str::to_string);
            return Some(self.fail(format!(
                "the external endpoint failed mid-answer: {message}"
            )));
        }
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            let count = |k: &str| u32::try_from(u[k].as_u64().unwrap_or(0)).unwrap_or(u32::MAX);
            self.usage = Some((count("prompt_tokens"), count("completion_tokens")));
        }
        let choice = v["choices"].get(0)?;
        match choice["finish_reason"].as_str() {
            Some("length") => self.finish = Some(Finish::Length),
            Some(_) => self.finish = Some(Finish::Stop),
            None => {}
        }
        let text = if self.chat {
            choice["delta"]["content"].as_str()
        } else {
            choice["text"].as_str()
        };
        let text = text.filter(|t| !t.is_empty())?;
        self.pieces = self.pieces.saturating_add(1);
        Some(Ok(Event::Text(text.to_string())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(chunks: &[&[u8]], chat: bool) -> Vec<String> {
        let mut d = SseDecoder::new(chat);
        let mut out = Vec::new();
        for c in chunks {
            d.push(c);
            while let Some(e) = d.next_event() {
                out.push(format!("{e:?}"));
            }
        }
        out.extend(d.finish().map(|e| format!("{e:?}")));
        out
    }

    #[test]
    fn events_do_not_depend_on_how_the_bytes_are_split() {
        let body = b"data: {\"choices\": [{\"text\": \"Hel\"}]}\n\n: keep-alive\n\
                     data: {\"choices\": [{\"text\": \"lo\", \"finish_reason\": \"length\"}]}\r\n\
                     data: {\"usage\": {\"prompt_tokens\": 3, \"completion_tokens\": 2}, \"choices\": []}\n\
                     data: [DONE]\n\ndata: {\"choices\": [{\"text\": \"after\"}]}\n";
        let whole = decode(&[body], false);
        assert_eq!(whole.len(), 3, "{whole:?}");
        assert!(
            whole[2].contains("Length") && whole[2].contains("prompt_tokens: 3"),
            "{whole:?}"
        );
        let bytes: Vec<&[u8]> = body.chunks(1).collect();
        assert_eq!(decode(&bytes, false), whole);
        let sevens: Vec<&[u8]> = body.chunks(7).collect();
        assert_eq!(decode(&sevens, false), whole);
    }

    #[test]
    fn an_endless_line_ends_the_stream_instead_of_growing() {
        let mut d = SseDecoder::new(true);
        let chunk = vec![b'x'; 1 << 20];
        let mut error = None;
        for _ in 0..8 {
            d.push(&chunk);
            if let Some(e) = d.next_event() {
                error = Some(e);
                break;
            }
        }
        let Some(Err(e)) = error else {
            panic!("no error: {error:?}")
        };
        assert!(e.message.contains("longer than"), "{}", e.message);
        assert!(d.ended() && d.buffer.is_empty());
        assert!(d.finish().is_none());
    }

    #[test]
    fn a_stream_cut_short_is_an_error() {
        let out = decode(
            &[b"data: {\"choices\": [{\"delta\": {\"content\": \"Hi\"}}]}\n"],
            true,
        );
        assert_eq!(out.len(), 2);
        assert!(out[1].contains("ended its stream early"), "{out:?}");
    }
}
