//! Reading a server-sent event stream (the APIs' `stream: true` answers)
//! the way a client does: the `data:` payload of each event, in order.
//!
//! ```text
//!  bytes ─► split at blank lines ─► "data: {...}" ─► each(payload) ─► go on / stop
//! ```

use futures::{Stream, StreamExt};

/// Hands each event's `data:` payload (`[DONE]` included) to `each`, which
/// says whether to stop; `Ok(true)` when it did, `Ok(false)` when the stream
/// ended first, and the error of `each` or of the stream.
pub async fn each_event<B, E>(
    stream: impl Stream<Item = Result<B, E>>,
    mut each: impl FnMut(&str) -> Result<bool, String>,
) -> Result<bool, String>
where
    B: AsRef<[u8]>,
    E: std::fmt::Display,
{
    let mut stream = std::pin::pin!(stream);
    let mut buffer = String::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| format!("the stream broke: {e}"))?;
        buffer.push_str(&String::from_utf8_lossy(chunk.as_ref()));
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            if let Some(data) = event.trim().strip_prefix("data: ")
                && each(data)?
            {
                return Ok(true);
            }
        }
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn events_split_across_chunks_arrive_whole_and_in_order() {
        let chunks: Vec<Result<&[u8], String>> = vec![
            Ok(b"data: {\"a\"".as_slice()),
            Ok(b":1}\n\n: a comment\n\ndata: two\n"),
            Ok(b"\ndata: [DONE]\n\ndata: after\n\n"),
        ];
        let mut seen = Vec::new();
        let stopped = each_event(futures::stream::iter(chunks), |d| {
            seen.push(d.to_string());
            Ok(d == "[DONE]")
        })
        .await;
        assert_eq!(stopped, Ok(true));
        assert_eq!(seen, ["{\"a\":1}", "two", "[DONE]"]);
        let cut: Vec<Result<&[u8], &str>> = vec![Ok(b"data: x\n\n"), Err("reset")];
        let broke = each_event(futures::stream::iter(cut), |_| Ok(false)).await;
        assert_eq!(broke, Err("the stream broke: reset".into()));
    }
}
