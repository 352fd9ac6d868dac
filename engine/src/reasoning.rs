//! Reasoning: the text a model writes between `<think>` and `</think>`
//! before its answer (DeepSeek-R1 and its distills, QwQ, Qwen 3) is told
//! apart from the answer as it streams, so APIs can give it as reasoning
//! (`reasoning_content`, thinking blocks) instead of as the answer.
//!
//! ```text
//!  prompt ends in <think> ───────────────► Inside ──"</think>"──► Answer
//!  answer starts with <think> ─► Undecided ─┘                      ▲
//!  anything else ─────────────► Undecided ─────────────────────────┘
//!  pieces ─► ThinkSplitter::push ─► (reasoning, answer text)
//! ```
//!
//! Only an answer's start can open reasoning: `<think>` later in an answer
//! is answer text. Whitespace right after `</think>` (templates put a blank
//! line there) is dropped.

/// Opens reasoning.
pub const THINK_OPEN: &str = "<think>";
/// Closes reasoning.
pub const THINK_CLOSE: &str = "</think>";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Nothing but whitespace or a part of `<think>` yet.
    Undecided,
    /// In the reasoning.
    Inside,
    /// Reasoning just closed: whitespace is still dropped.
    Closed,
    /// The answer.
    Answer,
}

/// Splits an answer's text into reasoning and answer as it streams.
#[derive(Debug, Clone)]
pub struct ThinkSplitter {
    mode: Mode,
    pending: String,
}

/// Whether a prompt (its text, or its last tokens' text) leaves the model
/// inside reasoning: templates of R1-style models end the generation prompt
/// with `<think>`.
pub fn prompt_opens_reasoning(prompt_tail: &str) -> bool {
    prompt_tail.trim_end().ends_with(THINK_OPEN)
}

/// The length of the longest end of `text` that could begin `marker`.
fn partial_suffix(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

impl ThinkSplitter {
    /// A splitter at an answer's start; `inside` when the prompt opened the
    /// reasoning.
    pub fn new(inside: bool) -> Self {
        ThinkSplitter {
            mode: if inside {
                Mode::Inside
            } else {
                Mode::Undecided
            },
            pending: String::new(),
        }
    }

    /// Whether the answer is past its reasoning (or has none).
    pub fn answering(&self) -> bool {
        self.mode == Mode::Answer
    }

    /// Whether the answer is inside its reasoning (opened and not yet
    /// closed).
    pub fn in_reasoning(&self) -> bool {
        self.mode == Mode::Inside
    }

    /// Takes the next piece of the answer: the reasoning and the answer's
    /// text it completes (text that may be part of a marker is held).
    pub fn push(&mut self, piece: &str) -> (String, String) {
        let (mut reasoning, mut answer) = (String::new(), String::new());
        self.pending.push_str(piece);
        loop {
            match self.mode {
                Mode::Answer => {
                    answer.push_str(&std::mem::take(&mut self.pending));
                    break;
                }
                Mode::Undecided => {
                    let t = self.pending.trim_start();
                    if let Some(rest) = t.strip_prefix(THINK_OPEN) {
                        self.pending = rest.to_string();
                        self.mode = Mode::Inside;
                    } else if t.is_empty() || THINK_OPEN.starts_with(t) {
                        break;
                    } else {
                        self.mode = Mode::Answer;
                    }
                }
                Mode::Inside => {
                    if let Some(at) = self.pending.find(THINK_CLOSE) {
                        reasoning.push_str(&self.pending[..at]);
                        self.pending.drain(..at + THINK_CLOSE.len());
                        self.mode = Mode::Closed;
                    } else {
                        let keep = partial_suffix(&self.pending, THINK_CLOSE);
                        let cut = self.pending.len() - keep;
                        reasoning.push_str(&self.pending[..cut]);
                        self.pending.drain(..cut);
                        break;
                    }
                }
                Mode::Closed => {
                    let t = self.pending.trim_start();
                    if t.is_empty() {
                        self.pending.clear();
                        break;
                    }
                    self.pending = t.to_string();
                    self.mode = Mode::Answer;
                }
            }
        }
        (reasoning, answer)
    }

    /// Ends the answer: what is still held (reasoning cut short by the
    /// token limit stays reasoning; a lone part of `<think>` is text).
    pub fn finish(self) -> (String, String) {
        match self.mode {
            Mode::Inside => (self.pending, String::new()),
            Mode::Closed => (String::new(), String::new()),
            Mode::Undecided | Mode::Answer => (String::new(), self.pending),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(inside: bool, pieces: &[&str]) -> (String, String) {
        let mut s = ThinkSplitter::new(inside);
        let (mut reasoning, mut answer) = (String::new(), String::new());
        for p in pieces {
            let (r, a) = s.push(p);
            reasoning.push_str(&r);
            answer.push_str(&a);
        }
        let (r, a) = s.finish();
        (reasoning + &r, answer + &a)
    }

    #[test]
    fn reasoning_is_told_from_the_answer_whatever_the_pieces() {
        let whole = "<think>\nThe user greets.\n</think>\n\nHello!";
        let expected = ("\nThe user greets.\n".to_string(), "Hello!".to_string());
        assert_eq!(split(false, &[whole]), expected);
        // Every character a piece of its own: markers split anywhere.
        let chars: Vec<String> = whole.chars().map(String::from).collect();
        let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(split(false, &pieces), expected);
        // An R1-style prompt opened the reasoning.
        assert_eq!(
            split(true, &["Short", " thought.</th", "ink>", "\n\nHi"]),
            ("Short thought.".into(), "Hi".into())
        );
    }

    #[test]
    fn answers_without_reasoning_pass_and_only_the_start_can_open_it() {
        assert_eq!(
            split(false, &["Hello", " <think>x</think>"]),
            (String::new(), "Hello <think>x</think>".into())
        );
        assert_eq!(split(false, &["  <thi"]), (String::new(), "  <thi".into()));
        assert_eq!(
            split(false, &["<b>bold</b>"]),
            (String::new(), "<b>bold</b>".into())
        );
        // Cut by the limit inside the reasoning: it stays reasoning.
        assert_eq!(
            split(false, &["<think>still thinking</thi"]),
            ("still thinking</thi".into(), String::new())
        );
        let mut s = ThinkSplitter::new(false);
        assert_eq!(s.push("<think>a"), ("a".into(), String::new()));
        assert!(!s.answering());
        assert_eq!(s.push("é</think>"), ("é".into(), String::new()));
        assert_eq!(s.push(" b"), (String::new(), "b".into()));
        assert!(s.answering());
    }

    #[test]
    fn prompts_that_open_reasoning_are_seen() {
        assert!(prompt_opens_reasoning("<｜Assistant｜><think>\n"));
        assert!(!prompt_opens_reasoning("<|im_start|>assistant\n"));
        assert!(!prompt_opens_reasoning("<think>\n\n</think>\n\n"));
    }
}
