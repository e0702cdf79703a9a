//! The names of the sidecar's Prometheus metrics and of their labels. They are a contract
//! (DESIGN.md): the sidecar exports them, the operator's collector and the dashboards read them,
//! so both sides take them from here. Every series carries [`MODEL`] and [`VERSION`].

/// Label: the model's name.
pub const MODEL: &str = "model";
/// Label: the model version.
pub const VERSION: &str = "version";
/// Label of [`REQUESTS`]: how a request ended ([`crate::outcome::Outcome::label`]).
pub const OUTCOME: &str = "outcome";
/// Label of [`WORKERS`]: `busy` or `idle`.
pub const STATE: &str = "state";
/// The tenant a request was for (names from the tenants file; `default` without one).
pub const TENANT: &str = "tenant";

/// Counter: requests by how they ended.
pub const REQUESTS: &str = "ferry_requests_total";
/// Requests by tenant and how they ended (labels `tenant`, `outcome`).
pub const TENANT_REQUESTS: &str = "ferry_tenant_requests_total";
/// Admission to dispatch, by tenant (label `tenant`).
pub const TENANT_QUEUE_WAIT: &str = "ferry_tenant_queue_wait_seconds";
/// Gauge: requests waiting in the queue.
pub const QUEUE_DEPTH: &str = "ferry_queue_depth";
/// Gauge: payload bytes waiting in the queue.
pub const QUEUE_BYTES: &str = "ferry_queue_bytes";
/// Gauge: seconds the oldest queued request has waited (0 when empty).
pub const QUEUE_OLDEST_AGE: &str = "ferry_queue_oldest_age_seconds";
/// Histogram: seconds from admission to dispatch.
pub const QUEUE_WAIT: &str = "ferry_queue_wait_seconds";
/// Histogram: seconds from admission to reply.
pub const REQUEST_DURATION: &str = "ferry_request_duration_seconds";
/// Histogram: rows per dispatched batch.
pub const BATCH_SIZE: &str = "ferry_batch_size";
/// Histogram: engine seconds per batch.
pub const BATCH_DURATION: &str = "ferry_batch_duration_seconds";
/// Gauge: engine workers by [`STATE`].
pub const WORKERS: &str = "ferry_workers";
/// Counter: engine results discarded (stale attempt, or after the deadline).
pub const LATE_RESULTS: &str = "ferry_late_results_total";

/// Histogram: seconds from arrival to a generation's first token.
pub const TIME_TO_FIRST_TOKEN: &str = "ferry_time_to_first_token_seconds";
/// Histogram: seconds between consecutive tokens of a generation.
pub const INTER_TOKEN_LATENCY: &str = "ferry_inter_token_latency_seconds";
/// Gauge: generation sequences by [`STATE`] (`running`, holding KV blocks, or `waiting`).
pub const SEQUENCES: &str = "ferry_sequences";
/// Gauge: KV-cache blocks by [`STATE`] (`used` or `free`).
pub const KV_BLOCKS: &str = "ferry_kv_blocks";
/// Gauge: used KV blocks over all blocks.
pub const KV_USAGE: &str = "ferry_kv_usage_ratio";
/// Gauge, always 1: the KV cache's layout in its labels, [`BLOCK_SIZE`] (tokens a block) and
/// [`BLOCKS`] (blocks in all), named as vLLM's `vllm:cache_config_info` names them, so that an
/// endpoint picker's prefix-cache scorer reads Ferry's as it reads vLLM's.
pub const KV_CACHE_CONFIG: &str = "ferry_kv_cache_config_info";
/// A label of [`KV_CACHE_CONFIG`].
pub const BLOCK_SIZE: &str = "block_size";
/// A label of [`KV_CACHE_CONFIG`].
pub const BLOCKS: &str = "num_gpu_blocks";
/// Counter: sequences that gave their KV blocks back to be recomputed.
pub const PREEMPTIONS: &str = "ferry_preemptions_total";
/// Counter: prompt tokens of admitted generations.
pub const PROMPT_TOKENS: &str = "ferry_prompt_tokens_total";
/// Counter: tokens generated and sent.
pub const GENERATION_TOKENS: &str = "ferry_generation_tokens_total";
/// Counter: prompt tokens of generations started with the prefix cache on (vLLM's
/// `prefix_cache_queries`).
pub const PREFIX_CACHE_QUERIES: &str = "ferry_prefix_cache_queries_total";
/// Counter: those of them the prefix cache held, not prefilled (vLLM's `prefix_cache_hits`).
pub const PREFIX_CACHE_HITS: &str = "ferry_prefix_cache_hits_total";
/// Histogram: tokens fed to the model per engine step.
pub const STEP_TOKENS: &str = "ferry_step_tokens";
/// Histogram: engine seconds per step.
pub const STEP_DURATION: &str = "ferry_step_duration_seconds";
/// Histogram: sequences per engine step (decodes and prefill chunks): the continuous batch's size.
pub const STEP_SEQUENCES: &str = "ferry_step_sequences";

/// Gauge: prompt tokens of waiting generation sequences (what `maxQueueTokens` bounds).
pub const QUEUE_TOKENS: &str = "ferry_queue_tokens";
/// Gauge: a generation step's cost as the sidecar has learned it, seconds per unit of each
/// [`TERM`] (`fixed`, `decode`, `prefill_token`, `context_token`, `attended_slot`): the prior (the
/// configured costs, or those the engine timed at load) until steps are measured.
pub const STEP_COST: &str = "ferry_step_cost_seconds";
/// Gauge: generation requests a second this pod serves with its three promises kept in 99 % of
/// them, at the shape of its recent requests (the prompts asked for, the answers finished:
/// [`crate::generation::capacity::RecentShape`]), from the start: at
/// [`crate::generation::capacity::PRIOR_SHAPE`] until requests show their own.
pub const CAPACITY_REQUESTS: &str = "ferry_capacity_requests_per_second";
/// Gauge: the generated tokens a second of [`CAPACITY_REQUESTS`].
pub const CAPACITY_TOKENS: &str = "ferry_capacity_tokens_per_second";
/// The label of [`STEP_COST`].
pub const TERM: &str = "term";
/// Gauge: the deadline a request gets when it names none, by [`PROMISE`]: `request`
/// (`spec.batching.latencyBudget`) for request-level services; `time_to_first_token` and
/// `inter_token` for generation. What the dashboards draw the measured latencies against.
pub const TARGET: &str = "ferry_target_seconds";
/// Gauge: 1 while the model version takes requests (its engine is ready, its batcher or step
/// loop runs, the pod is not draining), 0 otherwise; as `/v2/models/{name}/ready` says, at
/// each scrape. An engine or a batcher that stopped shows here before any request fails.
pub const READY: &str = "ferry_model_ready";
/// The label of [`TARGET`].
pub const PROMISE: &str = "promise";

/// Gauge: 1 while the model version has refused every request for 5 s though nothing was queued
/// or running ([`crate::lockout`]); `/v2/health/ready` then says why.
pub const ADMISSION_LOCKED: &str = "ferry_admission_locked";

/// The generation metrics above, for tests that check an exposition against the contract.
pub const GENERATION: [&str; 18] = [
    TIME_TO_FIRST_TOKEN,
    INTER_TOKEN_LATENCY,
    SEQUENCES,
    KV_BLOCKS,
    KV_USAGE,
    KV_CACHE_CONFIG,
    PREEMPTIONS,
    PROMPT_TOKENS,
    GENERATION_TOKENS,
    PREFIX_CACHE_QUERIES,
    PREFIX_CACHE_HITS,
    STEP_TOKENS,
    STEP_DURATION,
    STEP_SEQUENCES,
    QUEUE_TOKENS,
    STEP_COST,
    CAPACITY_REQUESTS,
    CAPACITY_TOKENS,
];

/// Every request-level metric name above, for tests that check an exposition against the contract.
pub const ALL: [&str; 13] = [
    REQUESTS,
    QUEUE_DEPTH,
    QUEUE_BYTES,
    QUEUE_OLDEST_AGE,
    QUEUE_WAIT,
    REQUEST_DURATION,
    BATCH_SIZE,
    BATCH_DURATION,
    WORKERS,
    LATE_RESULTS,
    ADMISSION_LOCKED,
    TARGET,
    READY,
];

/// The holder's metrics (one holder for the cluster's services at zero), labelled by the service
/// they are for: [`NAMESPACE`] and [`SERVICE`].
pub const NAMESPACE: &str = "namespace";
pub const SERVICE: &str = "service";
/// Counter: requests that reached the holder, by what it did at once (label [`OUTCOME`]: `held`,
/// `infeasible`, `queue_full` — the service's offered load — or `relayed` straight to a ready
/// pod, `not_found`, `invalid`, `too_large`).
pub const HOLDER_REQUESTS: &str = "ferry_holder_requests_total";
/// Counter: how held requests ended (label [`OUTCOME`]: `released` to a pod, `expired` at their
/// deadline, `cancelled` by their client).
pub const HOLDER_FINISHED: &str = "ferry_holder_finished_total";
/// Gauge: requests held now.
pub const HOLDER_HELD: &str = "ferry_holder_held";
/// Gauge, unlabelled: the services the holder was told of (a holder told of none still shows it is one).
pub const HOLDER_SERVICES: &str = "ferry_holder_services";
/// Gauge: seconds the longest-held request has waited (0 when none is).
pub const HOLDER_OLDEST_AGE: &str = "ferry_holder_oldest_held_seconds";
