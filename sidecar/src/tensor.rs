//! Open Inference Protocol tensors: the JSON of an infer request, parsed and checked into typed
//! tensors, and tensors written back as JSON.
//!
//! The rules follow the OIP v2 REST specification (`../shared/spec/`): `data` is row-major and
//! may be flat or nested, its element count must match the shape, and its elements must fit the
//! datatype. The first dimension is rows: rows of several requests share one batch.

use serde::ser::{SerializeMap, SerializeSeq};
use serde::{Deserialize, Serialize, Serializer};
use serde_json::{Map, Value};

use ferry_core::outcome::{Outcome, Refusal};

/// The tensor element types of the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DataType {
    Bool,
    Uint8,
    Uint16,
    Uint32,
    Uint64,
    Int8,
    Int16,
    Int32,
    Int64,
    Fp16,
    Fp32,
    Fp64,
    Bytes,
}

impl DataType {
    pub const ALL: [DataType; 13] = [
        DataType::Bool,
        DataType::Uint8,
        DataType::Uint16,
        DataType::Uint32,
        DataType::Uint64,
        DataType::Int8,
        DataType::Int16,
        DataType::Int32,
        DataType::Int64,
        DataType::Fp16,
        DataType::Fp32,
        DataType::Fp64,
        DataType::Bytes,
    ];

    pub fn name(self) -> &'static str {
        match self {
            DataType::Bool => "BOOL",
            DataType::Uint8 => "UINT8",
            DataType::Uint16 => "UINT16",
            DataType::Uint32 => "UINT32",
            DataType::Uint64 => "UINT64",
            DataType::Int8 => "INT8",
            DataType::Int16 => "INT16",
            DataType::Int32 => "INT32",
            DataType::Int64 => "INT64",
            DataType::Fp16 => "FP16",
            DataType::Fp32 => "FP32",
            DataType::Fp64 => "FP64",
            DataType::Bytes => "BYTES",
        }
    }

    pub fn parse(name: &str) -> Option<DataType> {
        DataType::ALL.into_iter().find(|d| d.name() == name)
    }

    /// Inclusive range of an integer type, as i128 so that every type fits.
    fn int_range(self) -> Option<(i128, i128)> {
        Some(match self {
            DataType::Uint8 => (0, u8::MAX.into()),
            DataType::Uint16 => (0, u16::MAX.into()),
            DataType::Uint32 => (0, u32::MAX.into()),
            DataType::Uint64 => (0, u64::MAX.into()),
            DataType::Int8 => (i8::MIN.into(), i8::MAX.into()),
            DataType::Int16 => (i16::MIN.into(), i16::MAX.into()),
            DataType::Int32 => (i32::MIN.into(), i32::MAX.into()),
            DataType::Int64 => (i64::MIN.into(), i64::MAX.into()),
            _ => return None,
        })
    }
}

/// Tensor elements, flat and row-major. Integers of every width are held as i128 (checked
/// against their type's range at parse time), floats as f64 (FP16 and FP32 values rounded to
/// f32 at parse time, so that what the engine sees is what the datatype can hold).
#[derive(Debug, Clone, PartialEq)]
pub enum TensorData {
    Bool(Vec<bool>),
    Int(Vec<i128>),
    Float(Vec<f64>),
    Bytes(Vec<String>),
}

impl TensorData {
    pub fn len(&self) -> usize {
        match self {
            TensorData::Bool(v) => v.len(),
            TensorData::Int(v) => v.len(),
            TensorData::Float(v) => v.len(),
            TensorData::Bytes(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A named, typed, shaped tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub name: String,
    pub datatype: DataType,
    pub shape: Vec<u64>,
    pub data: TensorData,
}

impl Tensor {
    /// The first dimension.
    pub fn rows(&self) -> u64 {
        self.shape.first().copied().unwrap_or(1)
    }

    /// The dimensions after the first.
    pub fn inner(&self) -> &[u64] {
        self.shape.get(1..).unwrap_or(&[])
    }

    /// Stacks tensors of one name, datatype and inner shape along the first dimension: the rows
    /// of several requests become one batch. `None` when they do not agree.
    pub fn concat_rows(parts: &[&Tensor]) -> Option<Tensor> {
        let first = *parts.first()?;
        if parts.iter().any(|t| t.datatype != first.datatype || t.inner() != first.inner()) {
            return None;
        }
        let mut data = first.data.clone();
        for t in &parts[1..] {
            match (&mut data, &t.data) {
                (TensorData::Bool(all), TensorData::Bool(more)) => all.extend_from_slice(more),
                (TensorData::Int(all), TensorData::Int(more)) => all.extend_from_slice(more),
                (TensorData::Float(all), TensorData::Float(more)) => all.extend_from_slice(more),
                (TensorData::Bytes(all), TensorData::Bytes(more)) => all.extend_from_slice(more),
                _ => return None,
            }
        }
        let mut shape = vec![parts.iter().map(|t| t.rows()).sum()];
        shape.extend_from_slice(first.inner());
        Some(Tensor { name: first.name.clone(), datatype: first.datatype, shape, data })
    }

    /// The inverse of [`Tensor::concat_rows`]: splits along the first dimension into parts of
    /// `rows` rows each. `None` when the rows do not add up.
    pub fn split_rows(&self, rows: &[u64]) -> Option<Vec<Tensor>> {
        if rows.iter().sum::<u64>() != self.rows() || self.rows() == 0 {
            return None;
        }
        let per_row = self.data.len() / self.rows() as usize;
        let mut start = 0;
        let mut out = Vec::with_capacity(rows.len());
        for &r in rows {
            let range = start..start + r as usize * per_row;
            start = range.end;
            let data = match &self.data {
                TensorData::Bool(v) => TensorData::Bool(v[range].to_vec()),
                TensorData::Int(v) => TensorData::Int(v[range].to_vec()),
                TensorData::Float(v) => TensorData::Float(v[range].to_vec()),
                TensorData::Bytes(v) => TensorData::Bytes(v[range].to_vec()),
            };
            let mut shape = vec![r];
            shape.extend_from_slice(self.inner());
            out.push(Tensor { name: self.name.clone(), datatype: self.datatype, shape, data });
        }
        Some(out)
    }
}

impl Serialize for Tensor {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        struct Elements<'a>(&'a Tensor);
        impl Serialize for Elements<'_> {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                let t = self.0;
                let mut seq = s.serialize_seq(Some(t.data.len()))?;
                match &t.data {
                    TensorData::Bool(v) => v.iter().try_for_each(|x| seq.serialize_element(x))?,
                    TensorData::Int(v) if t.datatype == DataType::Uint64 => {
                        v.iter().try_for_each(|x| seq.serialize_element(&(*x as u64)))?
                    }
                    TensorData::Int(v) => v.iter().try_for_each(|x| seq.serialize_element(&(*x as i64)))?,
                    // Written as f32 so that JSON shows the shortest text that reads back the same.
                    TensorData::Float(v) if t.datatype != DataType::Fp64 => {
                        v.iter().try_for_each(|x| seq.serialize_element(&(*x as f32)))?
                    }
                    TensorData::Float(v) => v.iter().try_for_each(|x| seq.serialize_element(x))?,
                    TensorData::Bytes(v) => v.iter().try_for_each(|x| seq.serialize_element(x))?,
                }
                seq.end()
            }
        }
        let mut map = s.serialize_map(Some(4))?;
        map.serialize_entry("name", &self.name)?;
        map.serialize_entry("datatype", self.datatype.name())?;
        map.serialize_entry("shape", &self.shape)?;
        map.serialize_entry("data", &Elements(self))?;
        map.end()
    }
}

/// The body of `POST .../infer` as it arrives.
#[derive(Debug, Deserialize)]
pub struct InferRequest {
    #[serde(default)]
    pub id: Option<String>,
    #[serde(default)]
    pub parameters: Option<Map<String, Value>>,
    pub inputs: Vec<RawTensor>,
    #[serde(default)]
    pub outputs: Option<Vec<RequestedOutput>>,
}

#[derive(Debug, Deserialize)]
pub struct RawTensor {
    pub name: String,
    pub shape: Vec<i64>,
    pub datatype: String,
    #[serde(default)]
    pub parameters: Option<Map<String, Value>>,
    /// Absent when the elements come as binary data ([`crate::front::binary`]).
    #[serde(default)]
    pub data: Value,
}

#[derive(Debug, Deserialize)]
pub struct RequestedOutput {
    pub name: String,
    #[serde(default)]
    pub parameters: Option<Map<String, Value>>,
}

/// The body of a successful infer response.
#[derive(Debug, Serialize)]
pub struct InferResponse<'a> {
    pub model_name: &'a str,
    pub model_version: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<&'a str>,
    pub outputs: &'a [Tensor],
}

/// Parses and checks the inputs of a request; returns them with their common row count.
/// `max_rows` is the service's `maxBatchSize`: a request with more rows could never ride.
pub fn parse_inputs(raw: Vec<RawTensor>, max_rows: u32) -> Result<(Vec<Tensor>, u32), Refusal> {
    if raw.is_empty() {
        return Err(Refusal::invalid("'inputs' is empty; a request needs at least one input tensor"));
    }
    let mut tensors: Vec<Tensor> = Vec::with_capacity(raw.len());
    for (i, input) in raw.into_iter().enumerate() {
        let tensor = parse_tensor(i, input)?;
        if tensors.iter().any(|t| t.name == tensor.name) {
            return Err(Refusal::invalid(format!("inputs[{i}]: the name '{}' is used twice", tensor.name)));
        }
        if let Some(first) = tensors.first() {
            if first.rows() != tensor.rows() {
                return Err(Refusal::invalid(format!(
                    "inputs[{i}] ('{}') has {} rows but '{}' has {}; every input of a request must have the same first dimension",
                    tensor.name,
                    tensor.rows(),
                    first.name,
                    first.rows()
                )));
            }
        }
        tensors.push(tensor);
    }
    let rows = tensors[0].rows();
    if rows > u64::from(max_rows) {
        return Err(Refusal::new(
            Outcome::TooLarge,
            format!(
                "input '{}' has {rows} rows; this service accepts at most {max_rows} per request (maxBatchSize)",
                tensors[0].name
            ),
        ));
    }
    Ok((tensors, rows as u32))
}

/// Parses and checks one tensor; `i` is its position, for messages.
pub fn parse_tensor(i: usize, raw: RawTensor) -> Result<Tensor, Refusal> {
    let at = |what: String| Refusal::invalid(format!("inputs[{i}] ('{}'): {what}", raw.name));
    if raw.name.is_empty() {
        return Err(Refusal::invalid(format!("inputs[{i}]: 'name' is empty")));
    }
    let datatype = DataType::parse(&raw.datatype).ok_or_else(|| {
        let known: Vec<&str> = DataType::ALL.iter().map(|d| d.name()).collect();
        at(format!("datatype '{}' is not one of {}", raw.datatype, known.join(", ")))
    })?;
    if raw.shape.is_empty() {
        return Err(at("shape [] has no first dimension; the first dimension is the number of rows".into()));
    }
    let mut shape = Vec::with_capacity(raw.shape.len());
    for (d, &n) in raw.shape.iter().enumerate() {
        if n < 0 {
            return Err(at(format!("shape[{d}] is {n}; dimensions of a request must be 0 or more")));
        }
        shape.push(n as u64);
    }
    if shape[0] == 0 {
        return Err(at("shape[0] is 0; a request needs at least one row".into()));
    }
    let expected = shape
        .iter()
        .try_fold(1u64, |acc, &n| acc.checked_mul(n))
        .filter(|&n| n <= u32::MAX as u64)
        .ok_or_else(|| at(format!("shape {:?} has too many elements", raw.shape)))?;

    if raw.data.is_null() {
        return Err(at("'data' is missing (and no parameters.binary_data_size says where binary data is)".into()));
    }
    let mut flat = Vec::with_capacity(expected as usize);
    flatten(&raw.data, &mut flat).map_err(|depth| at(format!("'data' is nested deeper than {depth} levels")))?;
    if flat.len() as u64 != expected {
        return Err(at(format!("'data' has {} elements, but shape {:?} needs {expected}", flat.len(), raw.shape)));
    }
    let bad = |k: usize, v: &Value, want: &str| at(format!("data[{k}] is {v}, which is not {want}"));
    let data = match datatype {
        DataType::Bool => TensorData::Bool(
            flat.iter()
                .enumerate()
                .map(|(k, v)| v.as_bool().ok_or_else(|| bad(k, v, "a boolean")))
                .collect::<Result<_, _>>()?,
        ),
        DataType::Bytes => TensorData::Bytes(
            flat.iter()
                .enumerate()
                .map(|(k, v)| v.as_str().map(str::to_owned).ok_or_else(|| bad(k, v, "a string")))
                .collect::<Result<_, _>>()?,
        ),
        DataType::Fp16 | DataType::Fp32 | DataType::Fp64 => TensorData::Float(
            flat.iter()
                .enumerate()
                .map(|(k, v)| {
                    let x = v.as_f64().ok_or_else(|| bad(k, v, "a number"))?;
                    Ok(if datatype == DataType::Fp64 { x } else { f64::from(x as f32) })
                })
                .collect::<Result<_, _>>()?,
        ),
        _ => {
            let (lo, hi) = datatype.int_range().expect("integer types have a range");
            TensorData::Int(
                flat.iter()
                    .enumerate()
                    .map(|(k, v)| {
                        let x = v.as_i64().map(i128::from).or_else(|| v.as_u64().map(i128::from));
                        match x {
                            Some(x) if (lo..=hi).contains(&x) => Ok(x),
                            _ => Err(bad(k, v, &format!("an integer in {}'s range {lo}..={hi}", datatype.name()))),
                        }
                    })
                    .collect::<Result<_, _>>()?,
            )
        }
    };
    Ok(Tensor { name: raw.name, datatype, shape, data })
}

/// Flattens row-major nested arrays into `out`. Errors with the depth limit when nested too deep
/// (a guard against stack exhaustion on hostile input).
fn flatten<'a>(value: &'a Value, out: &mut Vec<&'a Value>) -> Result<(), usize> {
    const MAX_DEPTH: usize = 32;
    fn go<'a>(value: &'a Value, out: &mut Vec<&'a Value>, depth: usize) -> Result<(), usize> {
        match value {
            Value::Array(items) if depth < MAX_DEPTH => items.iter().try_for_each(|v| go(v, out, depth + 1)),
            Value::Array(_) => Err(MAX_DEPTH),
            other => {
                out.push(other);
                Ok(())
            }
        }
    }
    match value {
        Value::Array(_) => go(value, out, 0),
        other => {
            out.push(other);
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn raw(v: Value) -> Vec<RawTensor> {
        serde_json::from_value::<InferRequest>(json!({ "inputs": v })).unwrap().inputs
    }

    #[test]
    fn flat_and_nested_data_are_the_same_tensor() {
        let flat =
            parse_inputs(raw(json!([{"name": "x", "shape": [2, 2], "datatype": "FP32", "data": [1, 2, 3, 4]}])), 8);
        let nested =
            parse_inputs(raw(json!([{"name": "x", "shape": [2, 2], "datatype": "FP32", "data": [[1, 2], [3, 4]]}])), 8);
        assert_eq!(flat.unwrap(), nested.unwrap());
    }

    #[test]
    fn element_count_must_match_the_shape() {
        let err = parse_inputs(raw(json!([{"name": "x", "shape": [2, 3], "datatype": "INT32", "data": [1, 2]}])), 8)
            .unwrap_err();
        assert_eq!(err.outcome, Outcome::Invalid);
        assert_eq!(err.message, "inputs[0] ('x'): 'data' has 2 elements, but shape [2, 3] needs 6");
    }

    #[test]
    fn elements_must_fit_the_datatype() {
        let err =
            parse_inputs(raw(json!([{"name": "x", "shape": [1], "datatype": "INT8", "data": [300]}])), 8).unwrap_err();
        assert!(err.message.contains("data[0] is 300, which is not an integer in INT8's range -128..=127"), "{}", err);
        let err =
            parse_inputs(raw(json!([{"name": "x", "shape": [1], "datatype": "BYTES", "data": [1]}])), 8).unwrap_err();
        assert!(err.message.contains("not a string"), "{err}");
        let err =
            parse_inputs(raw(json!([{"name": "x", "shape": [1], "datatype": "FP99", "data": [1]}])), 8).unwrap_err();
        assert!(err.message.contains("datatype 'FP99' is not one of BOOL"), "{err}");
    }

    #[test]
    fn more_rows_than_the_batch_cap_is_too_large() {
        let err =
            parse_inputs(raw(json!([{"name": "INPUT0", "shape": [70], "datatype": "FP32", "data": vec![0; 70]}])), 32)
                .unwrap_err();
        assert_eq!(err.outcome, Outcome::TooLarge);
        assert_eq!(
            err.message,
            "input 'INPUT0' has 70 rows; this service accepts at most 32 per request (maxBatchSize)"
        );
    }

    #[test]
    fn inputs_must_agree_on_rows_and_names() {
        let err = parse_inputs(
            raw(json!([
                {"name": "a", "shape": [2], "datatype": "FP32", "data": [1, 2]},
                {"name": "b", "shape": [3], "datatype": "FP32", "data": [1, 2, 3]}
            ])),
            8,
        )
        .unwrap_err();
        assert!(err.message.contains("same first dimension"), "{err}");
        let err = parse_inputs(
            raw(json!([
                {"name": "a", "shape": [1], "datatype": "FP32", "data": [1]},
                {"name": "a", "shape": [1], "datatype": "FP32", "data": [1]}
            ])),
            8,
        )
        .unwrap_err();
        assert!(err.message.contains("used twice"), "{err}");
    }

    #[test]
    fn shapes_need_a_positive_first_dimension() {
        for (shape, want) in
            [(json!([]), "no first dimension"), (json!([0]), "at least one row"), (json!([1, -1]), "shape[1] is -1")]
        {
            let err = parse_inputs(raw(json!([{"name": "x", "shape": shape, "datatype": "FP32", "data": []}])), 8)
                .unwrap_err();
            assert!(err.message.contains(want), "{err}");
        }
    }

    #[test]
    fn serializes_fp32_as_the_shortest_f32_text() {
        let (t, _) =
            parse_inputs(raw(json!([{"name": "x", "shape": [1], "datatype": "FP32", "data": [0.1]}])), 8).unwrap();
        assert_eq!(serde_json::to_string(&t[0]).unwrap(), r#"{"name":"x","datatype":"FP32","shape":[1],"data":[0.1]}"#);
    }

    #[test]
    fn rows_concatenate_and_split_back_in_order() {
        let (a, _) =
            parse_inputs(raw(json!([{"name": "x", "shape": [1, 2], "datatype": "INT32", "data": [1, 2]}])), 8).unwrap();
        let (b, _) =
            parse_inputs(raw(json!([{"name": "x", "shape": [2, 2], "datatype": "INT32", "data": [3, 4, 5, 6]}])), 8)
                .unwrap();
        let batch = Tensor::concat_rows(&[&a[0], &b[0]]).unwrap();
        assert_eq!(batch.shape, vec![3, 2]);
        assert_eq!(batch.data, TensorData::Int(vec![1, 2, 3, 4, 5, 6]));
        let parts = batch.split_rows(&[1, 2]).unwrap();
        assert_eq!((parts[0].clone(), parts[1].clone()), (a[0].clone(), b[0].clone()));
        assert!(batch.split_rows(&[1, 1]).is_none(), "rows must add up");
        let (c, _) =
            parse_inputs(raw(json!([{"name": "x", "shape": [1, 3], "datatype": "INT32", "data": [1, 2, 3]}])), 8)
                .unwrap();
        assert!(Tensor::concat_rows(&[&a[0], &c[0]]).is_none(), "inner shapes differ");
    }

    #[test]
    fn uint64_keeps_its_full_range() {
        let (t, _) =
            parse_inputs(raw(json!([{"name": "x", "shape": [1], "datatype": "UINT64", "data": [u64::MAX]}])), 8)
                .unwrap();
        assert_eq!(serde_json::to_value(&t[0]).unwrap()["data"], json!([u64::MAX]));
    }
}
