//! Stop-string matching across token boundaries, fed arbitrary text: up to
//! three stop strings and a text cut into pieces, all from the input. The
//! streamed result must equal the one computed on the whole text at once
//! (cut before the stop string that is complete first), however the text is
//! split; nothing given out contains a stop string; without a stop,
//! everything comes out. The matcher's own source file is compiled here, so
//! the fuzz build needs none of the engine's dependencies.
#![no_main]

#[path = "../../engine/src/stop.rs"]
#[allow(dead_code, missing_docs)]
mod stop;

use libfuzzer_sys::fuzz_target;
use stop::StopMatcher;

/// The whole text cut at the stop complete first (earliest end, then
/// earliest start), and whether one was found.
fn expected(text: &str, stops: &[String]) -> (String, bool) {
    let first = stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text.find(s.as_str()).map(|at| (at + s.len(), at)))
        .min();
    match first {
        Some((_, at)) => (text[..at].to_string(), true),
        None => (text.to_string(), false),
    }
}

fn streamed(pieces: &[&str], stops: &[String]) -> (String, bool) {
    let mut matcher = StopMatcher::new(stops);
    let mut out = String::new();
    for piece in pieces {
        let released = matcher.push(piece);
        out.push_str(&released.text);
        if released.stopped {
            return (out, true);
        }
    }
    out.push_str(&matcher.finish());
    (out, false)
}

fuzz_target!(|data: &[u8]| {
    // Fields separated by 0xFF (never in UTF-8): stops, then the pieces.
    let fields: Vec<&str> = data
        .split(|b| *b == 0xFF)
        .map(|f| std::str::from_utf8(f).unwrap_or(""))
        .collect();
    let Some((stop_field, pieces)) = fields.split_first() else {
        return;
    };
    let stops: Vec<String> = stop_field
        .split('\u{1}')
        .take(3)
        .map(str::to_string)
        .collect();
    let text: String = pieces.concat();
    let want = expected(&text, &stops);
    assert_eq!(streamed(pieces, &stops), want, "pieces {pieces:?}, stops {stops:?}");
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let chars: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(streamed(&chars, &stops), want, "one character at a time");
    for stop in stops.iter().filter(|s| !s.is_empty()) {
        assert!(!want.0.contains(stop.as_str()), "{stop:?} given out in {:?}", want.0);
    }
});
