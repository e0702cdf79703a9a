//! What the generation scheduler knows of a request: its prompt's length, how many tokens it may
//! produce, its three promises (first token, inter-token time, completion) and its priority —
//! never its text, its tokens or its connection.

use std::time::Duration;

use std::time::Instant;

use crate::outcome::{Outcome, Refusal};
use crate::tenant::TenantId;
use crate::ticket::Priority;

/// Sidecar-internal sequence number, assigned at arrival in increasing order.
pub type SeqId = u64;

/// One generation request as the scheduler sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub id: SeqId,
    pub arrival: Instant,
    pub priority: Priority,
    /// Whose it is: step tokens are shared between tenants by weight ([`crate::tenant`]).
    pub tenant: TenantId,
    /// Its tenant's weight (the tenants file's, as it stood when the request arrived).
    pub weight: u32,
    /// Prompt tokens.
    pub prompt: u32,
    /// The most tokens it may produce (`max_tokens`).
    pub max_tokens: u32,
    /// Payload size, counted against the queue's byte bound.
    pub bytes: u64,
    /// Its first token by then, or 504 before any byte of the answer.
    pub ttft_deadline: Instant,
    /// The longest step the scheduler may run while it decodes.
    pub itl: Duration,
    /// The whole answer by then.
    pub deadline: Instant,
}

impl Request {
    /// Its inter-token target, where it has one: a request for one token has no gap between
    /// tokens, and an upstream's learned inter-token time must not refuse it (nor narrow the
    /// window for it).
    pub fn itl_target(&self) -> Option<Duration> {
        (self.max_tokens > 1).then_some(self.itl)
    }
}

/// What waits in a queue of requests (the step rule's, the relay window's), for its bounds:
/// `--max-queue`, `--max-queue-bytes`, `--max-queue-tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Queued {
    pub requests: usize,
    pub bytes: u64,
    /// Prompt tokens; `estimated` where they are counted from bytes (an upstream's prompts).
    pub tokens: u64,
    pub estimated: bool,
}

impl Queued {
    /// 503 `queue_full` when `r` does not fit beside what waits, under `max` (requests, bytes,
    /// tokens): the one bound it breaks, named, with its value and its limit.
    pub fn room_for(&self, r: &Request, (requests, bytes, tokens): (usize, u64, u64)) -> Result<(), Refusal> {
        let full = |what: String| Refusal::new(Outcome::QueueFull, what).retry_after(Duration::from_secs(1));
        if self.requests >= requests {
            return Err(full(format!("queue full: {} requests waiting (--max-queue {requests})", self.requests)));
        }
        if self.bytes + r.bytes > bytes {
            return Err(full(format!(
                "queue full: {} bytes waiting and this request is {} (--max-queue-bytes {bytes})",
                self.bytes, r.bytes
            )));
        }
        if self.tokens + u64::from(r.prompt) > tokens {
            let about = if self.estimated { "about " } else { "" };
            return Err(full(format!(
                "queue full: {} prompt tokens waiting and this prompt has {about}{} (--max-queue-tokens {tokens})",
                self.tokens, r.prompt
            )));
        }
        Ok(())
    }
}

/// Why a sequence finished successfully, as OpenAI's `finish_reason` says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// It produced `max_tokens` tokens.
    Length,
    /// The model ended it (an end-of-sequence token, or a `stop` string).
    Stop,
    /// An upstream server ended it with a tool call (`--engine openai`).
    ToolCalls,
    /// An upstream server's content filter ended it.
    ContentFilter,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
            FinishReason::ToolCalls => "tool_calls",
            FinishReason::ContentFilter => "content_filter",
        }
    }
}

/// How a sequence ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    Finished(FinishReason),
    /// Ended without finishing: refused at admission, past a deadline, failed, cancelled; the
    /// refusal is what its caller is answered.
    Unfinished(Refusal),
}
