//! What a tensor group's leader asks of its followers, and their replies,
//! as bytes for followers in other processes.
//!
//! ```text
//!  leader ──Command──► follower: forward_batch / release (all-reduces inside)
//!         ◄──Reply────  ok | refused (the caller's input) | failed
//! ```
//!
//! Encoding (little-endian): a command is a tag byte — `1` step, `2`
//! release — then for a release the sequence `u64`; for a step the number
//! of inputs `u32` and per input the sequence `u64`, a kind byte (`0`
//! token ids, `1` hidden states), the rows `u32`, for hidden states the
//! width `u32`, then the ids as `u32` or the values as `f32`. A reply is a
//! byte — `0` done, `1` the caller's input refused, `2` failed — then the
//! message in UTF-8.

use crate::error::{Error, Result};
use crate::stage::{Activations, SequenceId, StageInput};

/// What the leader asks.
#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    /// Run one step of these sequences.
    Step(Vec<(SequenceId, StageInput)>),
    /// Free a sequence.
    Release(SequenceId),
}

/// A follower's answer: done, or why not (`true`: the caller's input).
pub type Reply = std::result::Result<(), (bool, String)>;

impl Command {
    /// The command as bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::new();
        match self {
            Command::Release(seq) => {
                b.push(2);
                b.extend_from_slice(&seq.to_le_bytes());
            }
            Command::Step(batch) => {
                b.push(1);
                b.extend_from_slice(&(batch.len() as u32).to_le_bytes());
                for (seq, input) in batch {
                    b.extend_from_slice(&seq.to_le_bytes());
                    match input {
                        StageInput::Tokens(ids) => {
                            b.push(0);
                            b.extend_from_slice(&(ids.len() as u32).to_le_bytes());
                            ids.iter()
                                .for_each(|i| b.extend_from_slice(&i.to_le_bytes()));
                        }
                        StageInput::Hidden(a) => {
                            b.push(1);
                            b.extend_from_slice(&(a.tokens as u32).to_le_bytes());
                            b.extend_from_slice(&(a.hidden as u32).to_le_bytes());
                            a.data
                                .iter()
                                .for_each(|v| b.extend_from_slice(&v.to_le_bytes()));
                        }
                    }
                }
            }
        }
        b
    }

    /// Reads a command, refusing anything malformed or truncated.
    pub fn decode(bytes: &[u8]) -> Result<Command> {
        let mut r = Reader(bytes);
        let command = match r.u8()? {
            2 => Command::Release(r.u64()?),
            1 => {
                let n = r.u32()? as usize;
                let mut batch = Vec::with_capacity(n.min(r.0.len() / 13));
                for _ in 0..n {
                    let seq = r.u64()?;
                    let input = match r.u8()? {
                        0 => {
                            let rows = r.u32()? as usize;
                            StageInput::Tokens(r.take(rows)?.map(u32::from_le_bytes).collect())
                        }
                        1 => {
                            let rows = r.u32()? as usize;
                            let width = r.u32()? as usize;
                            let count = rows.checked_mul(width).ok_or_else(malformed)?;
                            let data = r.take(count)?.map(f32::from_le_bytes).collect();
                            StageInput::Hidden(Activations::new(rows, width, data)?)
                        }
                        _ => return Err(malformed()),
                    };
                    batch.push((seq, input));
                }
                Command::Step(batch)
            }
            _ => return Err(malformed()),
        };
        if !r.0.is_empty() {
            return Err(malformed());
        }
        Ok(command)
    }
}

/// A reply as bytes.
pub fn encode_reply(reply: &Reply) -> Vec<u8> {
    match reply {
        Ok(()) => vec![0],
        Err((callers, why)) => {
            let mut b = vec![if *callers { 1 } else { 2 }];
            b.extend_from_slice(why.as_bytes());
            b
        }
    }
}

/// Reads a reply.
pub fn decode_reply(bytes: &[u8]) -> Result<Reply> {
    let why = || String::from_utf8_lossy(&bytes[1..]).into_owned();
    match bytes.first() {
        Some(0) if bytes.len() == 1 => Ok(Ok(())),
        Some(1) => Ok(Err((true, why()))),
        Some(2) => Ok(Err((false, why()))),
        _ => Err(malformed()),
    }
}

fn malformed() -> Error {
    Error::Tensor("a malformed message between the ranks of a group".into())
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn bytes(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.0.len() < n {
            return Err(malformed());
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.bytes(1)?[0])
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.bytes(4)?.try_into().expect("4 bytes"),
        ))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.bytes(8)?.try_into().expect("8 bytes"),
        ))
    }

    /// `count` items of `N` bytes each.
    fn take<const N: usize>(&mut self, count: usize) -> Result<impl Iterator<Item = [u8; N]> + 'a> {
        let bytes = self.bytes(count.checked_mul(N).ok_or_else(malformed)?)?;
        Ok(bytes
            .chunks_exact(N)
            .map(|c| c.try_into().expect("N bytes")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_and_replies_survive_the_trip() {
        let step = Command::Step(vec![
            (7, StageInput::Tokens(vec![1, 2, 3])),
            (
                9,
                StageInput::Hidden(Activations::new(2, 2, vec![0.5, -1.0, 2.0, 3.5]).unwrap()),
            ),
        ]);
        for c in [step, Command::Release(u64::MAX)] {
            assert_eq!(Command::decode(&c.encode()).unwrap(), c);
        }
        for r in [
            Ok(()),
            Err((true, "bad token".into())),
            Err((false, "x".into())),
        ] {
            assert_eq!(decode_reply(&encode_reply(&r)).unwrap(), r);
        }
    }

    #[test]
    fn truncated_or_padded_bytes_are_refused() {
        let bytes = Command::Step(vec![(1, StageInput::Tokens(vec![5; 10]))]).encode();
        for n in 0..bytes.len() {
            assert!(Command::decode(&bytes[..n]).is_err(), "{n} bytes");
        }
        let mut padded = bytes.clone();
        padded.push(0);
        assert!(Command::decode(&padded).is_err());
        // A count far past the bytes does not allocate it.
        let mut huge = vec![1];
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(Command::decode(&huge).is_err());
        assert!(decode_reply(&[]).is_err());
    }

    proptest::proptest! {
        /// Whatever bytes come, decoding answers (never panics) and what
        /// decodes encodes back to the same bytes.
        #[test]
        fn any_bytes_decode_or_are_refused(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..256)) {
            if let Ok(c) = Command::decode(&bytes) {
                proptest::prop_assert_eq!(c.encode(), bytes.clone());
            }
            let _ = decode_reply(&bytes);
        }

        #[test]
        fn steps_survive_the_trip(
            seqs in proptest::collection::vec((proptest::num::u64::ANY, proptest::collection::vec(0u32..50_000, 1..20)), 0..8),
        ) {
            let step = Command::Step(seqs.into_iter().map(|(s, ids)| (s, StageInput::Tokens(ids))).collect());
            proptest::prop_assert_eq!(Command::decode(&step.encode()).unwrap(), step);
        }
    }
}
