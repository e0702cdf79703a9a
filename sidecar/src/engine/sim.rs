//! The `sim` engine, for tests, demos and benchmarks: a batch takes `batchTime + perItem × rows`
//! of (tokio) time, and each request gets back one output `OUTPUT0` with the shape and datatype
//! of its first input and every element doubled (BOOL and BYTES echoed), so that a caller can
//! prove that it got its own rows back.
//!
//! Faults can be injected so that failure handling is testable: a batch fails with probability
//! `fail_rate`, and never returns with probability `hang_rate`, drawn from a seeded generator so
//! that a run can be repeated; and a batch holding a *poison* row (one whose first element equals
//! the configured value) always fails.

use std::sync::Mutex;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use std::time::Instant;

use super::spell::SlowSpell;
use super::{BatchOutputs, BoxFuture, Engine, EngineError, Inputs, Signature, TensorSpec, Tokens};
use crate::tensor::{DataType, Tensor, TensorData};

#[derive(Debug)]
pub struct SimEngine {
    batch_time: Duration,
    per_item: Duration,
    signature: Signature,
    faults: Faults,
    rng: Mutex<StdRng>,
    /// When it was built: its slow spell is timed from then.
    start: Instant,
}

/// Injected faults: probabilities per batch, the seed of the generator that draws them, and a
/// poison value.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Faults {
    pub fail_rate: f64,
    pub hang_rate: f64,
    pub seed: u64,
    /// A batch holding a row whose first element equals this fails.
    pub poison: Option<f64>,
    /// Batches that start within this spell are slower.
    pub slow: Option<SlowSpell>,
}

impl SimEngine {
    pub fn new(batch_time: Duration, per_item: Duration) -> Self {
        let spec = |name: &str| TensorSpec { name: name.into(), datatype: "FP32".into(), shape: vec![-1, -1] };
        SimEngine {
            batch_time,
            per_item,
            signature: Signature {
                platform: "ferry_sim".into(),
                inputs: vec![spec("INPUT0")],
                outputs: vec![spec("OUTPUT0")],
            },
            faults: Faults::default(),
            rng: Mutex::new(StdRng::seed_from_u64(0)),
            start: ferry_core::clock::now(),
        }
    }

    pub fn with_faults(mut self, faults: Faults) -> Self {
        self.rng = Mutex::new(StdRng::seed_from_u64(faults.seed));
        self.faults = faults;
        self
    }

    pub fn batch_time(&self, rows: u64) -> Duration {
        self.batch_time + self.per_item * rows as u32
    }
}

impl Engine for SimEngine {
    fn signature(&self) -> &Signature {
        &self.signature
    }

    /// The sim engine takes any tensor: its signature shows the typical one.
    fn check(&self, _inputs: &[Tensor]) -> Result<Tokens, String> {
        Ok(Tokens::default())
    }

    fn infer(&self, batch: Vec<Inputs>) -> BoxFuture<Result<BatchOutputs, EngineError>> {
        let rows: u64 = batch.iter().map(|inputs| inputs[0].rows()).sum();
        let took =
            SlowSpell::time(self.faults.slow.as_ref(), self.start, ferry_core::clock::now(), self.batch_time(rows));
        let (fail, hang) = {
            let mut rng = self.rng.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            (rng.random_bool(self.faults.fail_rate), rng.random_bool(self.faults.hang_rate))
        };
        let poisoned =
            self.faults.poison.and_then(|value| batch.iter().find_map(|inputs| poison_row(&inputs[0], value)));
        Box::pin(async move {
            if hang {
                return std::future::pending().await;
            }
            // A zero-time engine (the overhead benchmark) should not wait for a timer tick.
            if !took.is_zero() {
                tokio::time::sleep(took).await;
            }
            if let Some(row) = poisoned {
                return Err(EngineError(format!("poison row: its first element is {row} (--sim-poison)")));
            }
            if fail {
                return Err(EngineError("injected failure (--sim-fail-rate)".into()));
            }
            Ok(batch.iter().map(|inputs| vec![doubled(&inputs[0])]).collect())
        })
    }
}

/// The first element of the first row of `input` that starts with `value`, if any.
fn poison_row(input: &Tensor, value: f64) -> Option<f64> {
    let rows = input.rows().max(1) as usize;
    let width = input.data.len() / rows;
    (0..rows).map(|r| r * width).find_map(|i| {
        let first = match &input.data {
            TensorData::Float(v) => v.get(i).copied(),
            TensorData::Int(v) => v.get(i).map(|&x| x as f64),
            _ => None,
        }?;
        (first == value).then_some(first)
    })
}

fn doubled(input: &Tensor) -> Tensor {
    let data = match &input.data {
        TensorData::Int(v) => TensorData::Int(v.iter().map(|&x| wrap(input.datatype, x * 2)).collect()),
        TensorData::Float(v) if input.datatype == DataType::Fp64 => {
            TensorData::Float(v.iter().map(|x| x * 2.0).collect())
        }
        TensorData::Float(v) => TensorData::Float(v.iter().map(|&x| f64::from(x as f32 * 2.0)).collect()),
        other => other.clone(),
    };
    Tensor { name: "OUTPUT0".into(), datatype: input.datatype, shape: input.shape.clone(), data }
}

/// Integer doubling wraps around in the datatype's width, as the same arithmetic on a GPU would.
fn wrap(datatype: DataType, x: i128) -> i128 {
    match datatype {
        DataType::Uint8 => i128::from(x as u8),
        DataType::Uint16 => i128::from(x as u16),
        DataType::Uint32 => i128::from(x as u32),
        DataType::Uint64 => i128::from(x as u64),
        DataType::Int8 => i128::from(x as i8),
        DataType::Int16 => i128::from(x as i16),
        DataType::Int32 => i128::from(x as i32),
        _ => i128::from(x as i64),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn tensor(datatype: DataType, data: TensorData) -> Inputs {
        Arc::new(vec![Tensor { name: "x".into(), datatype, shape: vec![data.len() as u64], data }])
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_takes_its_configured_time_and_doubles_each_request() {
        let engine = SimEngine::new(Duration::from_millis(100), Duration::from_millis(2));
        let start = ferry_core::clock::now();
        let out = engine
            .infer(vec![
                tensor(DataType::Fp32, TensorData::Float(vec![1.5, -2.0])),
                tensor(DataType::Int8, TensorData::Int(vec![100, -3, 7])),
                tensor(DataType::Bytes, TensorData::Bytes(vec!["hi".into()])),
            ])
            .await
            .unwrap();
        assert_eq!(ferry_core::clock::elapsed(start), Duration::from_millis(112));
        assert_eq!(out[0][0].data, TensorData::Float(vec![3.0, -4.0]));
        assert_eq!(out[1][0].data, TensorData::Int(vec![-56, -6, 14])); // 200 wraps in INT8
        assert_eq!(out[2][0].data, TensorData::Bytes(vec!["hi".into()]));
        assert_eq!(out[1][0].name, "OUTPUT0");
        assert_eq!(out[1][0].shape, vec![3]);
    }

    #[tokio::test(start_paused = true)]
    async fn injected_failures_are_errors_after_the_batch_time() {
        let faults = Faults { fail_rate: 1.0, seed: 7, ..Faults::default() };
        let engine = SimEngine::new(Duration::from_millis(50), Duration::ZERO).with_faults(faults);
        let start = ferry_core::clock::now();
        let err = engine.infer(vec![tensor(DataType::Fp32, TensorData::Float(vec![1.0]))]).await.unwrap_err();
        assert!(err.0.contains("--sim-fail-rate"));
        assert_eq!(ferry_core::clock::elapsed(start), Duration::from_millis(50));
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_with_a_poison_row_fails() {
        let engine = SimEngine::new(Duration::from_millis(5), Duration::ZERO)
            .with_faults(Faults { poison: Some(-1.0), ..Faults::default() });
        let healthy = Arc::new(vec![Tensor {
            name: "x".into(),
            datatype: DataType::Fp32,
            shape: vec![2, 2],
            data: TensorData::Float(vec![1.0, -1.0, 2.0, 3.0]),
        }]);
        let poison = Arc::new(vec![Tensor {
            name: "x".into(),
            datatype: DataType::Fp32,
            shape: vec![2, 2],
            data: TensorData::Float(vec![1.0, 2.0, -1.0, 3.0]),
        }]);
        assert!(engine.infer(vec![healthy.clone()]).await.is_ok(), "-1 is not the first element of a row");
        let err = engine.infer(vec![healthy, poison]).await.unwrap_err();
        assert_eq!(err.0, "poison row: its first element is -1 (--sim-poison)");
    }

    #[tokio::test(start_paused = true)]
    async fn a_hung_batch_never_returns() {
        let faults = Faults { hang_rate: 1.0, seed: 7, ..Faults::default() };
        let engine = SimEngine::new(Duration::from_millis(50), Duration::ZERO).with_faults(faults);
        let run = engine.infer(vec![tensor(DataType::Fp32, TensorData::Float(vec![1.0]))]);
        assert!(tokio::time::timeout(Duration::from_secs(3600), run).await.is_err());
    }
}
