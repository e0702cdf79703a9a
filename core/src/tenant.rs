//! Fair shares between tenants (DESIGN.md, "Tenants"): the one rule both schedulers compose with
//! — seats of a batch (rows) and tokens of a step — so that a tenant that sends ten times as much
//! as another does not get ten times the seats.
//!
//! The rule is start-time fair queueing, the continuous form of deficit round-robin: each tenant
//! has a *virtual service*, the work it was given divided by its weight, and the next seat goes to
//! the backlogged tenant with the least. A tenant's own requests keep their order (deadline order:
//! the rule only chooses *whose* turn it is). A tenant that was idle does not bank credit: its
//! service is lifted to the *floor* — the least service of the tenants that were backlogged when
//! work was last given out — so it shares from the moment it has work, and takes no more than its
//! share afterwards. With one tenant the order is exactly its own: fairness changes nothing.

use std::iter::Peekable;

/// A tenant as the schedulers know it: a small number the sidecar assigns from the tenants file
/// (names never reach the core). Tenant 0 is `default`, every caller when no file is configured.
pub type TenantId = u16;

pub const DEFAULT_TENANT: TenantId = 0;

/// Virtual service of one unit of work (a row, a token) at weight 1: fine enough that weights up
/// to 65 536 still divide it into whole numbers, and a u64 lasts 2^48 units of work at weight 1.
const UNIT: u64 = 1 << 16;

/// The tenants' weights and the service each has had, for one tier of one scheduler.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Shares {
    /// By tenant; a tenant not listed has weight 1.
    weights: Vec<u32>,
    served: Vec<u64>,
    floor: u64,
}

impl Shares {
    /// Sets a tenant's weight (at least 1: a tenant of weight 0 would never be served).
    pub fn set_weight(&mut self, tenant: TenantId, weight: u32) {
        let i = usize::from(tenant);
        if self.weights.len() <= i {
            self.weights.resize(i + 1, 1);
        }
        self.weights[i] = weight.max(1);
    }

    pub fn weight(&self, tenant: TenantId) -> u32 {
        self.weights.get(usize::from(tenant)).copied().unwrap_or(1)
    }

    /// The tenant's virtual service as its next turn sees it: never below the floor.
    pub fn served(&self, tenant: TenantId) -> u64 {
        self.served.get(usize::from(tenant)).copied().unwrap_or(0).max(self.floor)
    }

    /// What `amount` units of work cost `tenant` in virtual service.
    pub(crate) fn cost(&self, tenant: TenantId, amount: u64) -> u64 {
        (amount.saturating_mul(UNIT)).div_ceil(u64::from(self.weight(tenant)))
    }

    /// `tenant` was given `amount` units of work (rows of a batch, tokens of a step).
    pub fn charge(&mut self, tenant: TenantId, amount: u64) {
        let i = usize::from(tenant);
        if self.served.len() <= i {
            self.served.resize(i + 1, 0);
        }
        self.served[i] = self.served(tenant).saturating_add(self.cost(tenant, amount));
    }

    /// Work was given out that started at virtual time `start` (the least service, before their
    /// charge, of the tenants it went to), with tenants still backlogged; `None` when nobody
    /// waits any more. The floor rises to `start` (start-time fair queueing's virtual time), or,
    /// when nobody waits, to the most any tenant has had: an idle system owes nobody anything,
    /// and who comes next starts level with who was served last.
    pub fn advance(&mut self, start: Option<u64>) {
        let level = start.unwrap_or_else(|| self.served.iter().copied().max().unwrap_or(0));
        self.floor = self.floor.max(level);
    }

    /// Interleaves the tenants' `lanes` (each in its own order) in fair order: each item goes to
    /// the lane whose tenant has had the least service so far (ties to the earlier lane), and
    /// charges it `amount(item)`. The shares themselves are not changed: this is what the next
    /// batches would look like, for dispatch and for admission's forecast alike.
    pub fn merge<'a, T: 'a>(
        &self,
        lanes: impl IntoIterator<Item = (TenantId, Box<dyn Iterator<Item = T> + 'a>)>,
        amount: impl Fn(&T) -> u64 + 'a,
    ) -> FairMerge<'a, T> {
        let lanes = lanes
            .into_iter()
            .map(|(tenant, items)| Lane { tenant, served: self.served(tenant), items: items.peekable() })
            .collect();
        FairMerge { shares: self.clone(), lanes, amount: Box::new(amount) }
    }
}

struct Lane<'a, T> {
    tenant: TenantId,
    served: u64,
    items: Peekable<Box<dyn Iterator<Item = T> + 'a>>,
}

/// The items of several tenants' lanes in fair order ([`Shares::merge`]).
pub struct FairMerge<'a, T> {
    shares: Shares,
    lanes: Vec<Lane<'a, T>>,
    amount: Box<dyn Fn(&T) -> u64 + 'a>,
}

impl<'a, T> Iterator for FairMerge<'a, T> {
    type Item = T;

    fn next(&mut self) -> Option<T> {
        let lane =
            self.lanes.iter_mut().filter_map(|l| l.items.peek().is_some().then_some(l)).min_by_key(|l| l.served)?;
        let item = lane.items.next().expect("peeked");
        lane.served = lane.served.saturating_add(self.shares.cost(lane.tenant, (self.amount)(&item)));
        Some(item)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Lanes = Vec<(TenantId, Box<dyn Iterator<Item = (TenantId, usize)>>)>;

    fn lanes(spec: &[(TenantId, usize)]) -> Lanes {
        spec.iter()
            .map(|&(t, n)| (t, Box::new((0..n).map(move |i| (t, i))) as Box<dyn Iterator<Item = (TenantId, usize)>>))
            .collect()
    }

    fn counts(order: &[(TenantId, usize)], first: usize) -> [usize; 3] {
        let mut c = [0; 3];
        for (t, _) in &order[..first] {
            c[usize::from(*t)] += 1;
        }
        c
    }

    #[test]
    fn equal_weights_alternate_whatever_the_backlog() {
        let shares = Shares::default();
        let order: Vec<_> = shares.merge(lanes(&[(1, 100), (2, 10)]), |_| 1).collect();
        assert_eq!(counts(&order, 20), [0, 10, 10]);
        // Each lane keeps its own order.
        let light: Vec<usize> = order.iter().filter(|(t, _)| *t == 2).map(|(_, i)| *i).collect();
        assert_eq!(light, (0..10).collect::<Vec<_>>());
        assert_eq!(order.len(), 110);
    }

    #[test]
    fn weights_three_to_one_give_seats_three_to_one() {
        let mut shares = Shares::default();
        shares.set_weight(1, 3);
        let order: Vec<_> = shares.merge(lanes(&[(1, 100), (2, 100)]), |_| 1).collect();
        assert_eq!(counts(&order, 40), [0, 30, 10]);
    }

    #[test]
    fn the_amount_is_the_work_not_the_count() {
        // Tenant 1's items are 4 rows each: it gets a quarter of the items for the same rows.
        let shares = Shares::default();
        let order: Vec<_> = shares.merge(lanes(&[(1, 100), (2, 100)]), |(t, _)| if *t == 1 { 4 } else { 1 }).collect();
        assert_eq!(counts(&order, 25), [0, 5, 20]);
    }

    #[test]
    fn an_idle_tenant_banks_no_credit() {
        let mut shares = Shares::default();
        // Tenant 1 alone was given 1000 rows, a row at a time, while tenant 2 was idle.
        for _ in 0..1000 {
            let start = shares.served(1);
            shares.charge(1, 1);
            shares.advance(Some(start));
        }
        // Tenant 2 arrives: it is lifted to the floor (where tenant 1's last row started), so it
        // gets one seat of credit, then shares, rather than taking the next 1000 seats.
        let order: Vec<_> = shares.merge(lanes(&[(1, 100), (2, 100)]), |_| 1).collect();
        assert_eq!(order[0].0, 2);
        assert_eq!(counts(&order, 21), [0, 10, 11]);
        // Nobody waiting: the floor rises to the most served, and a returning tenant starts there.
        shares.charge(2, 10);
        shares.advance(None);
        assert_eq!(shares.served(2), shares.served(1));
    }

    #[test]
    fn a_weight_of_zero_is_one() {
        let mut shares = Shares::default();
        shares.set_weight(3, 0);
        assert_eq!(shares.weight(3), 1);
        assert_eq!(shares.weight(9), 1);
    }
}
