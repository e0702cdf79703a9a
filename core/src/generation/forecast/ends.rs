//! When the forecast's decoders end, by the step they end at: a calendar of buckets, one for
//! each of the next `len` steps, each bucket a list threaded through the sequences. Every end
//! lies within that window (a sequence produces no more tokens than `len` − 1), so one bucket
//! never holds two different steps; the next end is found by walking the buckets from the
//! current step, which over a whole forecast walks each step once. A binary heap did the same in
//! O(log n) a pop, the forecast's largest cost at a thousand sequences.

/// No sequence: the end of a list.
const NONE: u32 = u32::MAX;

#[derive(Debug, Clone)]
pub(super) struct Ends {
    /// Per bucket, the first sequence ending at its step.
    heads: Vec<u32>,
    /// Per sequence, the next in its bucket.
    next: Vec<u32>,
    mask: u64,
}

impl Ends {
    /// A calendar for `sequences` sequences, none of which ends more than `horizon` steps after
    /// it is put in.
    pub(super) fn new(sequences: usize, horizon: u64) -> Ends {
        let len = (horizon + 1).next_power_of_two();
        Ends { heads: vec![NONE; len as usize], next: vec![NONE; sequences], mask: len - 1 }
    }

    /// Sequence `i` ends at step `end`, within the horizon of the current step.
    pub(super) fn put(&mut self, end: u64, i: usize) {
        let bucket = &mut self.heads[(end & self.mask) as usize];
        self.next[i] = *bucket;
        *bucket = i as u32;
    }

    /// The first step after `k` at which a sequence ends (one must, within the horizon).
    pub(super) fn after(&self, k: u64) -> Option<u64> {
        (k + 1..=k + self.mask + 1).find(|step| self.heads[(step & self.mask) as usize] != NONE)
    }

    /// Takes the sequences that end at step `k`.
    pub(super) fn take(&mut self, k: u64, ended: &mut Vec<usize>) {
        let mut i = std::mem::replace(&mut self.heads[(k & self.mask) as usize], NONE);
        while i != NONE {
            ended.push(i as usize);
            i = self.next[i as usize];
        }
    }
}
