//! Stop strings across token boundaries: text that might be the start of a
//! stop string is held back until it is known not to be one, so a stop string
//! is never partly streamed to the client.

/// Watches generated text for stop strings.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

/// What the matcher lets through for one piece of text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Released {
    /// Text safe to give out.
    pub text: String,
    /// Whether a stop string was found (generation ends; it is not in `text`).
    pub stopped: bool,
}

impl StopMatcher {
    /// A matcher for `stops` (none: every piece passes straight through).
    pub fn new(stops: &[String]) -> Self {
        StopMatcher {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
        }
    }

    /// Adds generated text; returns what can be given out now.
    ///
    /// Generation stops at the stop string that is complete first: the
    /// occurrence that ends earliest (of those, the one that starts
    /// earliest). That is the same however the text is split into pieces,
    /// since text that could begin a stop string is always held back.
    pub fn push(&mut self, piece: &str) -> Released {
        self.pending.push_str(piece);
        if let Some((_, at)) = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()).map(|at| (at + s.len(), at)))
            .min()
        {
            let text = self.pending[..at].to_string();
            self.pending.clear();
            return Released {
                text,
                stopped: true,
            };
        }
        let hold = self.longest_stop_prefix_suffix();
        let cut = self.pending.len() - hold;
        let text = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        Released {
            text,
            stopped: false,
        }
    }

    /// Text still held back when generation ends for another reason.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// Length of the longest end of `pending` that begins some stop string.
    fn longest_stop_prefix_suffix(&self) -> usize {
        let mut best = 0;
        for stop in &self.stops {
            let max = stop.len().min(self.pending.len());
            for len in (best + 1..=max).rev() {
                let start = self.pending.len() - len;
                if self.pending.is_char_boundary(start) && stop.starts_with(&self.pending[start..])
                {
                    best = len;
                    break;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut out = String::new();
        for p in pieces {
            let r = m.push(p);
            out.push_str(&r.text);
            if r.stopped {
                return (out, true);
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn a_stop_string_split_across_pieces_is_caught_and_not_given_out() {
        assert_eq!(
            run(&["STOP"], &["hello S", "TO", "P world"]),
            ("hello ".into(), true)
        );
        assert_eq!(run(&["\n\n"], &["a\n", "\nb"]), ("a".into(), true));
    }

    #[test]
    fn a_near_miss_is_released_once_it_cannot_match() {
        let stops = vec!["STOP".to_string()];
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push("ab ST").text, "ab ", "\"ST\" may begin STOP: held");
        assert_eq!(m.push("ay").text, "STay");
        assert_eq!(
            run(&["STOP"], &["ST"]),
            ("ST".into(), false),
            "held text is given out at the end"
        );
    }

    #[test]
    fn the_earliest_of_several_stops_wins() {
        assert_eq!(
            run(&["world", "lo"], &["hello world"]),
            ("hel".into(), true)
        );
    }

    #[test]
    fn the_stop_complete_first_wins_however_the_text_is_split() {
        // "bc" is complete before "abcd" is: whole or in pieces.
        for pieces in [&["abcd"][..], &["abc", "d"], &["a", "b", "c", "d"]] {
            assert_eq!(
                run(&["abcd", "bc"], pieces),
                ("a".into(), true),
                "{pieces:?}"
            );
        }
        // Ending together, the longer (earlier-starting) one is cut.
        assert_eq!(run(&["c", "abc"], &["xabcd"]), ("x".into(), true));
    }

    #[test]
    fn multibyte_text_is_never_cut_inside_a_character() {
        assert_eq!(run(&["é!"], &["café", "?"]), ("café?".into(), false));
        assert_eq!(run(&["é!"], &["caf", "é", "!"]), ("caf".into(), true));
    }

    #[test]
    fn without_stops_everything_passes() {
        let mut m = StopMatcher::new(&[]);
        assert_eq!(
            m.push("abc"),
            Released {
                text: "abc".into(),
                stopped: false
            }
        );
    }
}
