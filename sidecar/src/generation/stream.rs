//! What a caller holds while its generation runs: a [`Stream`] of text pieces and one end, from
//! whichever shell serves the model (the step shell, or the relay to an upstream server). Each
//! piece is checked against the request's deadlines at the moment the caller takes it: a token
//! taken after its deadline (or a first token after the TTFT deadline) is never given, the stream
//! ends with the deadline's refusal instead. The stream counts the request's outcome, once;
//! dropped before its end (the client went away), it cancels the sequence and counts `cancelled`.

use std::time::Duration;

use std::time::Instant;
use tokio::sync::mpsc;

use crate::tally::Tally;
use ferry_core::generation::sequence::{FinishReason, SeqId};
use ferry_core::outcome::{Outcome, Refusal};

/// How a generation finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finished {
    pub reason: FinishReason,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// Arrival to its first step.
    pub queued: Duration,
    /// Arrival to its first token.
    pub ttft: Duration,
}

/// What a caller receives: pieces of text, then one end. A token's text comes with its
/// log-probabilities where the request asked for them.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Text(String, Option<Box<TokenLogprob>>),
    /// An upstream server's choice chunk, passed on as it sent it (tool calls, reasoning, its
    /// logprobs, its `index` where it answers `n` > 1), with its text.
    Relayed {
        text: String,
        choice: Box<serde_json::Value>,
    },
    End(Result<Finished, Refusal>),
}

impl Piece {
    /// Part of the answer (not its end): checked against the deadlines as a token.
    pub fn is_token(&self) -> bool {
        matches!(self, Piece::Text(..) | Piece::Relayed { .. })
    }
}

/// A token of the answer as OpenAI's `logprobs` show it: its bytes and log-probability, and the
/// most likely tokens' at its place.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: Vec<u8>,
    pub logprob: f32,
    pub top: Vec<(Vec<u8>, f32)>,
}

/// A piece on its way, with the instant the shell sent it.
pub(crate) struct Sent {
    pub piece: Piece,
    pub at: Instant,
    /// With the first token: arrival to the sequence's first step.
    pub queued: Option<Duration>,
}

/// What a stream tells the shell that serves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    /// The caller went away (or its answer was late): end the sequence.
    Cancel(SeqId),
    /// A first token took this long from the shell to its caller (part of the deadline margin).
    Trip(Duration),
}

/// The deadlines a stream checks.
pub trait Deadlines {
    fn arrival(&self) -> Instant;
    fn ttft_deadline(&self) -> Instant;
    fn deadline(&self) -> Instant;
}

/// A caller's view of its generation. Each piece is checked against the deadlines when it is
/// taken: a token taken after its deadline (or a first token after the TTFT deadline) is never
/// given; the stream ends with the deadline's refusal instead. Dropping the stream before its end
/// cancels the sequence.
pub struct Stream {
    id: SeqId,
    rx: mpsc::UnboundedReceiver<Sent>,
    control: Box<dyn Fn(Control) + Send + Sync>,
    /// Counts the request's outcome once; dropped uncounted, it counts `cancelled`.
    tally: Option<Tally>,
    late_results: prometheus::IntCounter,
    arrival: Instant,
    ttft_deadline: Instant,
    deadline: Instant,
    seen_first: bool,
    ended: bool,
    queued: Option<Duration>,
    first_at: Option<Instant>,
}

impl Stream {
    pub(crate) fn new(
        id: SeqId,
        rx: mpsc::UnboundedReceiver<Sent>,
        control: Box<dyn Fn(Control) + Send + Sync>,
        tally: Option<Tally>,
        late_results: prometheus::IntCounter,
        deadlines: &dyn Deadlines,
    ) -> Stream {
        Stream {
            id,
            rx,
            control,
            tally,
            late_results,
            arrival: deadlines.arrival(),
            ttft_deadline: deadlines.ttft_deadline(),
            deadline: deadlines.deadline(),
            seen_first: false,
            ended: false,
            queued: None,
            first_at: None,
        }
    }

    /// The shell is gone: the request fails before it started.
    pub(crate) fn fail_now(&mut self) {
        self.count(Outcome::Failed);
        self.ended = true;
    }

    /// Arrival to the sequence's first step, once its first token has been taken.
    pub fn queued(&self) -> Option<Duration> {
        self.queued
    }

    /// When its first token was taken.
    pub fn first_token_at(&self) -> Option<Instant> {
        self.first_at
    }

    /// The next piece; `None` after the end.
    pub async fn next(&mut self) -> Option<Piece> {
        if self.ended {
            return None;
        }
        let Some(sent) = self.rx.recv().await else {
            self.ended = true;
            // The task is gone (a bug).
            self.count(Outcome::Failed);
            return Some(Piece::End(Err(Refusal::new(Outcome::Failed, "the generator stopped before answering"))));
        };
        let now = ferry_core::clock::now();
        let late = match &sent.piece {
            piece if piece.is_token() && !self.seen_first => now > self.ttft_deadline || now > self.deadline,
            Piece::Text(..) | Piece::Relayed { .. } | Piece::End(Ok(_)) => now > self.deadline,
            Piece::End(Err(_)) => false,
        };
        if late {
            self.ended = true;
            self.late_results.inc();
            (self.control)(Control::Cancel(self.id));
            let (what, limit) = if self.seen_first {
                ("deadline", self.deadline)
            } else {
                ("TTFT deadline", self.ttft_deadline.min(self.deadline))
            };
            let refusal = Refusal::new(
                Outcome::Expired,
                format!(
                    "{what} passed while the answer was on its way: {} ms after arrival; the {what} was {} ms",
                    (now - self.arrival).as_millis(),
                    (limit - self.arrival).as_millis()
                ),
            );
            self.count(Outcome::Expired);
            return Some(Piece::End(Err(refusal)));
        }
        match &sent.piece {
            Piece::Text(..) | Piece::Relayed { .. } => {
                if !self.seen_first {
                    self.seen_first = true;
                    self.queued = sent.queued;
                    self.first_at = Some(now);
                    (self.control)(Control::Trip(now.saturating_duration_since(sent.at)));
                }
            }
            Piece::End(end) => {
                self.ended = true;
                self.count(end.as_ref().map_or_else(|r| r.outcome, |_| Outcome::Ok));
            }
        }
        Some(sent.piece)
    }

    fn count(&mut self, outcome: Outcome) {
        if let Some(tally) = self.tally.take() {
            tally.count(outcome);
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if !self.ended {
            (self.control)(Control::Cancel(self.id));
        }
    }
}
