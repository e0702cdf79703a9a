//! The three dashboards. Every query reads the variables `namespace` and `inferenceservice`
//! (and `model`, `version` on sidecar series), so one dashboard serves every service; rates are
//! over Grafana's `$__rate_interval`.

use ferry_core::metric as m;
use serde_json::Value;

use super::grafana::{query, Board};
use super::promql::{judged, missed, offered, quantile, refused_for_capacity, select, SERVICE_VARS, SIDECAR_VARS};
use crate::metrics as op;

const RANGE: &str = "$__rate_interval";

/// A sidecar selector over the dashboard's variables, with `extra` matchers.
fn s(extra: &str) -> String {
    select(&SIDECAR_VARS, extra)
}

/// An operator (per-service) selector.
fn o(extra: &str) -> String {
    select(&SERVICE_VARS, extra)
}

fn rate(metric: &str, selector: &str) -> String {
    format!("rate({metric}{selector}[{RANGE}])")
}

/// p50 and p99 of a histogram, and the target the sidecar applies by default.
fn against_target(histogram: &str, promise: &str) -> Vec<super::grafana::Query> {
    vec![
        query(quantile(0.5, histogram, &s(""), "", RANGE), "p50"),
        query(quantile(0.99, histogram, &s(""), "", RANGE), "p99"),
        query(format!("max({}{})", m::TARGET, s(&format!("{}=\"{promise}\"", m::PROMISE))), "target"),
    ]
}

fn variables(board: Board, metric: &str, sidecar: bool) -> Board {
    let board = board.variable("namespace", "Namespace", metric, "").variable(
        "inferenceservice",
        "InferenceService",
        metric,
        "{namespace=~\"$namespace\"}",
    );
    if !sidecar {
        return board;
    }
    board
        .variable("model", "Model", metric, "{namespace=~\"$namespace\", inferenceservice=~\"$inferenceservice\"}")
        .variable(
            "version",
            "Version",
            metric,
            "{namespace=~\"$namespace\", inferenceservice=~\"$inferenceservice\", model=~\"$model\"}",
        )
}

/// *Service*: what callers got, and why.
pub fn service() -> Value {
    let board = Board::new(
        "ferry-service",
        "Ferry / Service",
        "What an InferenceService's callers got: offered against served, the share answered within deadline, \
         why the rest were not, the queue, batches, and for generation the three promises, sequences, KV cache and tokens.",
    );
    let board = variables(board, m::REQUESTS, true);
    let ok = s("outcome=\"ok\"");
    let board = board
        .row("Requests")
        .panel(
            "Offered and served",
            "Offered: admitted, or refused for want of capacity. Served: answered within its deadline.",
            "reqps",
            vec![
                query(format!("sum({})", rate(m::REQUESTS, &s(&offered()))), "offered"),
                query(format!("sum({})", rate(m::REQUESTS, &ok)), "served within deadline"),
            ],
        )
        .panel(
            "Share within deadline",
            "Requests answered within their deadline over those offered (a client that went away first counts in neither).",
            "percentunit",
            vec![query(
                format!("sum({}) / sum({})", rate(m::REQUESTS, &ok), rate(m::REQUESTS, &s(&judged()))),
                "within deadline",
            )],
        )
        .panel(
            "Outcomes other than ok",
            "Every other way a request ended, by the outcome label (DESIGN.md's outcome table).",
            "reqps",
            vec![query(format!("sum by (outcome) ({})", rate(m::REQUESTS, &s("outcome!=\"ok\""))), "{{outcome}}")],
        )
        .panel(
            "Queue depth",
            "Requests waiting for a batch or a sequence slot, over the selected pods.",
            "short",
            vec![query(format!("sum({}{})", m::QUEUE_DEPTH, s("")), "waiting")],
        )
        .panel(
            "Oldest queued request",
            "How long the oldest waiting request has waited, on the worst pod.",
            "s",
            vec![query(format!("max({}{})", m::QUEUE_OLDEST_AGE, s("")), "oldest")],
        )
        .panel(
            "Request latency against its target",
            "Admission to reply, against the default deadline (spec.batching.latencyBudget).",
            "s",
            against_target(m::REQUEST_DURATION, "request"),
        )
        .row("Batches (request-level services)")
        .panel(
            "Batch fill",
            "Rows per dispatched batch, on average.",
            "short",
            vec![query(
                format!(
                    "sum({}) / sum({})",
                    rate(&format!("{}_sum", m::BATCH_SIZE), &s("")),
                    rate(&format!("{}_count", m::BATCH_SIZE), &s(""))
                ),
                "rows per batch",
            )],
        )
        .panel(
            "Batch time",
            "Engine time per batch.",
            "s",
            vec![
                query(quantile(0.5, m::BATCH_DURATION, &s(""), "", RANGE), "p50"),
                query(quantile(0.99, m::BATCH_DURATION, &s(""), "", RANGE), "p99"),
            ],
        )
        .panel(
            "Workers",
            "Engine workers busy and idle.",
            "short",
            vec![query(format!("sum by (state) ({}{})", m::WORKERS, s("")), "{{state}}")],
        )
        .row("Generation")
        .panel(
            "Time to first token against its target",
            "Arrival to first token, against the default deadline (spec.generation.ttftBudget).",
            "s",
            against_target(m::TIME_TO_FIRST_TOKEN, "time_to_first_token"),
        )
        .panel(
            "Inter-token latency against its target",
            "Time between consecutive tokens, against spec.generation.maxInterTokenLatency.",
            "s",
            against_target(m::INTER_TOKEN_LATENCY, "inter_token"),
        )
        .panel(
            "Sequences",
            "Running sequences hold KV blocks and decode each step; waiting ones are queued for a prefill.",
            "short",
            vec![query(format!("sum by (state) ({}{})", m::SEQUENCES, s("")), "{{state}}")],
        )
        .panel(
            "KV-cache usage",
            "Used KV blocks over all blocks, per pod. Above 90 % with preemptions, more pods help.",
            "percentunit",
            vec![query(format!("max by (pod) ({}{})", m::KV_USAGE, s("")), "{{pod}}")],
        )
        .panel(
            "Preemptions",
            "Sequences that gave their KV blocks back to be recomputed, a second.",
            "short",
            vec![query(format!("sum({})", rate(m::PREEMPTIONS, &s(""))), "preemptions/s")],
        )
        .panel(
            "Tokens a second",
            "Prompt tokens admitted (and those of them the prefix cache held, not prefilled) and tokens generated, against the tokens a second the pods serve with their promises kept.",
            "short",
            vec![
                query(format!("sum({})", rate(m::PROMPT_TOKENS, &s(""))), "prompt"),
                query(format!("sum({})", rate(m::PREFIX_CACHE_HITS, &s(""))), "prompt from the prefix cache"),
                query(format!("sum({})", rate(m::GENERATION_TOKENS, &s(""))), "generated"),
                // A pod that has finished no request yet exports NaN: left out of the sum.
                query(format!("sum({}{} >= 0)", m::CAPACITY_TOKENS, s("")), "capacity (generated)"),
            ],
        )
        .panel(
            "Prompt tokens waiting",
            "Prompt tokens of waiting sequences (what spec.generation.maxQueueTokens bounds).",
            "short",
            vec![query(format!("sum({}{})", m::QUEUE_TOKENS, s("")), "waiting")],
        )
        .panel(
            "Step time",
            "Engine time per step: what every running sequence waits between two tokens.",
            "s",
            vec![
                query(quantile(0.5, m::STEP_DURATION, &s(""), "", RANGE), "p50"),
                query(quantile(0.99, m::STEP_DURATION, &s(""), "", RANGE), "p99"),
            ],
        )
        .row("Health")
        .panel(
            "Pods taking requests",
            "Pods whose model takes requests (engine ready, batcher or step loop running, not draining), and pods \
             refusing every request while idle (an estimate locked shut: FerryAdmissionLocked).",
            "short",
            vec![
                query(format!("sum({}{})", m::READY, s("")), "ready"),
                query(format!("sum({}{})", m::ADMISSION_LOCKED, s("")), "locked"),
            ],
        )
        .panel(
            "Late results",
            "Engine results discarded because their attempt was stale or their deadline had passed: the fence worked, \
             but the engine ran past an estimate.",
            "short",
            vec![query(format!("sum({})", rate(m::LATE_RESULTS, &s(""))), "late/s")],
        );
    board.build()
}

/// *Autoscaler*: what the operator saw and did.
pub fn autoscaler() -> Value {
    let board = Board::new(
        "ferry-autoscaler",
        "Ferry / Autoscaler",
        "Why an InferenceService has the pods it has: replicas desired, ready and starting, decisions by reason, \
         the offered load against the capacity of the ready pods, and the measured time to ready.",
    );
    let board = variables(board, op::REPLICAS, false);
    let ready = o("state=\"ready\"");
    board
        .row("Decisions")
        .panel(
            "Replicas",
            "Desired (the last decision), ready, starting (asked for or on their way) and stuck (unready too long), \
             against spec.scaling.maxReplicas.",
            "short",
            vec![
                query(format!("sum by (state) ({}{})", op::REPLICAS, o("")), "{{state}}"),
                query(format!("sum({}{})", op::REPLICA_LIMIT, o("bound=\"max\"")), "maxReplicas"),
            ],
        )
        .panel(
            "Decisions by reason",
            "What each decision was for: load, backlog, pressure, settling, structural, steady, warming, cooling, peak, scale_down, to_zero, from_zero.",
            "short",
            vec![query(
                format!("sum by (reason) (increase({}{}[{RANGE}]))", op::DECISIONS, o("")),
                "{{reason}}",
            )],
        )
        .panel(
            "Load against capacity",
            "Requests a second offered, against what the ready pods serve within their deadlines.",
            "reqps",
            vec![
                query(format!("sum({}{})", op::OFFERED, o("")), "offered"),
                query(
                    format!(
                        "sum(max by (namespace, inferenceservice) ({}{}) * max by (namespace, inferenceservice) ({}{ready}))",
                        op::CAPACITY_PER_REPLICA,
                        o(""),
                        op::REPLICAS
                    ),
                    "capacity of the ready pods",
                ),
            ],
        )
        .panel(
            "Time to ready",
            "From asking for a pod to its serving: spec.scaling.startupTime, and the median the operator measured.",
            "s",
            vec![query(format!("max by (source) ({}{})", op::STARTUP, o("")), "{{source}}")],
        )
        .panel(
            "Refused for capacity",
            "Requests the pods refused because no capacity could serve them in time: what scaling up is for.",
            "reqps",
            vec![query(
                format!("sum({})", rate(m::REQUESTS, &o(&refused_for_capacity()))),
                "refused for capacity",
            )],
        )
        .panel(
            "Operator",
            "Reconciles, and the operator's failed scrapes of its pods (their load is then unknown).",
            "short",
            vec![
                query(format!("sum(rate({}[{RANGE}]))", op::RECONCILES), "reconciles/s"),
                query(format!("sum(rate({}[{RANGE}]))", op::SCRAPE_FAILURES), "failed scrapes/s"),
            ],
        )
        .build()
}

/// *Tenants*: how the service shared itself.
pub fn tenants() -> Value {
    let board = Board::new(
        "ferry-tenants",
        "Ferry / Tenants",
        "How an InferenceService's tenants fared: each one's share within deadline, its requests, its quota refusals \
         and how long its requests waited.",
    );
    let board = variables(board, m::TENANT_REQUESTS, false).variable(
        "tenant",
        "Tenant",
        m::TENANT_REQUESTS,
        "{namespace=~\"$namespace\", inferenceservice=~\"$inferenceservice\"}",
    );
    let t = |extra: &str| select(&["namespace", "inferenceservice", "tenant"], extra);
    board
        .row("Tenants")
        .panel(
            "Share within deadline by tenant",
            "Each tenant's requests answered within their deadline over those it offered.",
            "percentunit",
            vec![query(
                format!(
                    "sum by (tenant) ({}) / sum by (tenant) ({})",
                    rate(m::TENANT_REQUESTS, &t("outcome=\"ok\"")),
                    rate(m::TENANT_REQUESTS, &t(&judged()))
                ),
                "{{tenant}}",
            )],
        )
        .panel(
            "Offered by tenant",
            "Requests a second each tenant offered.",
            "reqps",
            vec![query(format!("sum by (tenant) ({})", rate(m::TENANT_REQUESTS, &t(&offered()))), "{{tenant}}")],
        )
        .panel(
            "Quota refusals by tenant",
            "Requests refused because the tenant was over its quota (429 with Retry-After).",
            "reqps",
            vec![query(
                format!("sum by (tenant) ({})", rate(m::TENANT_REQUESTS, &t("outcome=\"quota\""))),
                "{{tenant}}",
            )],
        )
        .panel(
            "Queue wait by tenant",
            "Admission to dispatch, p99, per tenant: a flooding tenant must not raise a light one's.",
            "s",
            vec![query(quantile(0.99, m::TENANT_QUEUE_WAIT, &t(""), "tenant", RANGE), "{{tenant}}")],
        )
        .panel(
            "Missed by tenant",
            "Admitted requests that expired at their deadline or failed, per tenant.",
            "reqps",
            vec![query(format!("sum by (tenant) ({})", rate(m::TENANT_REQUESTS, &t(&missed()))), "{{tenant}}")],
        )
        .build()
}
