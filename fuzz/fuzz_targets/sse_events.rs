//! The decoder of an external endpoint's server-sent events, fed arbitrary
//! bytes: the first byte picks chat or text and a chunk size, the rest is the
//! body. However the body is split, the events are the same; at most one
//! `Done` or error comes, and it comes last; never a panic, and the buffer
//! stays bounded (libFuzzer's malloc limit).
#![no_main]

use libfuzzer_sys::fuzz_target;
use shardplane_gateway::protocol::Event;
use shardplane_gateway::sse::SseDecoder;

fn decode(chunks: &[&[u8]], chat: bool) -> Vec<String> {
    let mut decoder = SseDecoder::new(chat);
    let mut out = Vec::new();
    let mut terminal = false;
    let mut record = |e: Result<Event, shardplane_gateway::protocol::ApiError>, out: &mut Vec<String>| {
        assert!(!terminal, "an event after the end: {e:?}");
        terminal = matches!(e, Ok(Event::Done { .. }) | Err(_));
        out.push(format!("{e:?}"));
    };
    for chunk in chunks {
        decoder.push(chunk);
        while let Some(e) = decoder.next_event() {
            record(e, &mut out);
        }
    }
    if let Some(e) = decoder.finish() {
        record(e, &mut out);
    }
    assert!(decoder.ended());
    assert!(decoder.next_event().is_none());
    out
}

fuzz_target!(|data: &[u8]| {
    let Some((&control, body)) = data.split_first() else {
        return;
    };
    let chat = control & 1 == 1;
    let step = usize::from(control >> 1) + 1;
    let whole = decode(&[body], chat);
    let pieces: Vec<&[u8]> = body.chunks(step).collect();
    assert_eq!(decode(&pieces, chat), whole, "split every {step} bytes");
});
