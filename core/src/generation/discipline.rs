//! How steps are composed. Ferry's rule keeps deadlines; the others are what other servers do,
//! kept so that the benchmark compares them on the same trace with the same engine. The step rule
//! (and admission, and the ledger) ask the discipline for the property that differs at each point
//! — the order of the queue, whether tenants share it, whether deadlines are kept, whether
//! batches run whole — and name no discipline.

use std::time::Instant;

use super::sequence::{Request, SeqId};
use crate::ticket::Priority;

/// How steps are composed. Ferry's rule is [`Discipline::Deadlines`]; the others are what other
/// servers do, kept so that the benchmark compares them on the same trace with the same engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Discipline {
    /// The step rule of this module, with admission's forecast and deadlines enforced.
    #[default]
    Deadlines,
    /// Continuous batching without deadlines, as vLLM schedules: first come, first served,
    /// everything within the queue bounds admitted, prefill bounded by the token budget only,
    /// the latest arrival preempted, no sequence ended before it finishes.
    Fcfs,
    /// Static batching: a batch of up to `maxSequences` starts when the engine is free of the
    /// last one and runs until its longest sequence ends; nobody joins meanwhile.
    Static,
}

impl Discipline {
    /// Whether it keeps deadlines: admission forecasts every promise, a sequence ends at its
    /// deadline, decode steps are cut to the tightest inter-token target, and preemption spares
    /// the least slack. The others take everything the queue holds and run it to its end.
    pub fn keeps_deadlines(self) -> bool {
        self == Discipline::Deadlines
    }

    /// Whether a tier's queue is shared between its tenants by weight; the others know no
    /// tenants (as other servers).
    pub fn shares_tenants(self) -> bool {
        self.keeps_deadlines()
    }

    /// Whether a batch starts only when the last has left the engine, and runs whole.
    pub fn batches_whole(self) -> bool {
        self == Discipline::Static
    }

    /// The order sequences start in: priority, then first-token deadline; the others first come,
    /// first served.
    pub(crate) fn order(self, r: &Request) -> (Priority, Instant, SeqId) {
        if self.keeps_deadlines() {
            (r.priority, r.ttft_deadline, r.id)
        } else {
            (Priority::Interactive, r.arrival, r.id)
        }
    }
}
