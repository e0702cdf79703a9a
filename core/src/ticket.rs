//! What the scheduler knows of a request: its timing and size, never its payload or connection.

use std::time::Instant;

use crate::estimate::Shape;
use crate::tenant::TenantId;

/// Sidecar-internal request number, assigned at arrival in increasing order (so it also breaks
/// ties in arrival order).
pub type RequestId = u64;

/// Interactive requests are served first; batch-tier requests ride in the seats they leave empty.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum Priority {
    #[default]
    Interactive,
    Batch,
}

impl Priority {
    pub fn parse(text: &str) -> Option<Priority> {
        match text {
            "interactive" => Some(Priority::Interactive),
            "batch" => Some(Priority::Batch),
            _ => None,
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

/// One admitted (or to-be-admitted) request as the scheduler sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket {
    pub id: RequestId,
    pub arrival: Instant,
    /// Absolute: no answer is sent after it.
    pub deadline: Instant,
    /// First dimension of its inputs; `maxBatchSize` counts these.
    pub rows: u32,
    /// Payload size, counted against `--max-queue-bytes`.
    pub bytes: u64,
    pub priority: Priority,
    /// Whose it is: seats are shared between tenants by weight ([`crate::tenant`]).
    pub tenant: TenantId,
    /// Its tenant's weight (the tenants file's, as it stood when the request arrived).
    pub weight: u32,
    /// Tokens of its rows, for engines whose batch time grows with sequence length (else zero).
    pub tokens: Tokens,
}

/// What a request's rows weigh in tokens: an engine that pads a batch to its longest row pays
/// for `rows × longest`, one that packs pays for `total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Tokens {
    pub total: u32,
    pub longest: u32,
}

impl Ticket {
    /// The ticket's share of a batch's shape.
    pub fn shape(&self) -> Shape {
        Shape { rows: self.rows, tokens: self.tokens.total, longest: self.tokens.longest }
    }
}
