//! Every data-plane message an agent or the gateway decodes from the network,
//! fed arbitrary bytes: decoding never panics, what decodes re-encodes to the
//! same message, and hidden states are checked without panicking or
//! allocating more than the message holds.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shardplane_dataplane as dp;
use shardplane_dataplane::prost::Message;

fn round_trip<M: Message + Default>(data: &[u8]) -> Option<M> {
    let m = M::decode(data).ok()?;
    let bytes = m.encode_to_vec();
    let again = M::decode(bytes.as_slice()).expect("an encoded message decodes");
    // Compared as bytes: floats may be NaN, which equals nothing.
    assert_eq!(again.encode_to_vec(), bytes);
    Some(m)
}

fuzz_target!(|data: &[u8]| {
    if let Some(m) = round_trip::<dp::ForwardRequest>(data)
        && let Some(dp::forward_request::Message::Step(step)) = m.message
        && let Some(h) = step.hidden
        && let Ok(values) = dp::decode_hidden(&h)
    {
        assert_eq!(values.len() as u64, h.tokens as u64 * h.width as u64);
        assert_eq!(dp::encode_f32(&values).len(), h.data.len());
    }
    round_trip::<dp::GenerateRequest>(data);
    round_trip::<dp::GenerateResponse>(data);
    round_trip::<dp::ForwardResponse>(data);
    round_trip::<dp::ReadBlobRequest>(data);
    round_trip::<dp::BlobChunk>(data);
    round_trip::<dp::PingRequest>(data);
});
