//! Triton's binary tensor data extension of the Open Inference Protocol's REST API, which the
//! Triton HTTP client uses by default: the body is the JSON request, then raw tensor bytes.
//!
//! Request: the `inference-header-content-length` header gives the JSON part's length; each input
//! whose `parameters.binary_data_size` is set takes that many bytes of the binary part, in input
//! order (no `data` in the JSON). Response: outputs asked for as binary (request parameter
//! `binary_data_output`, or an output's `binary_data`) go after the JSON, each announced by its
//! `parameters.binary_data_size`, with the header set to the JSON's length.
//!
//! Element encodings, as Triton's: little-endian numbers, one byte per BOOL, and for BYTES each
//! element as a 4-byte little-endian length followed by its bytes.

use axum::http::{HeaderMap, HeaderName};
use serde_json::{Map, Number, Value};

use crate::tensor::{DataType, RawTensor, Tensor, TensorData};
use ferry_core::outcome::Refusal;

pub const HEADER: HeaderName = HeaderName::from_static("inference-header-content-length");

/// The JSON part and the binary part of a body (the binary part is empty without the header).
pub fn split<'a>(headers: &HeaderMap, body: &'a [u8]) -> Result<(&'a [u8], &'a [u8]), Refusal> {
    let Some(value) = headers.get(&HEADER) else { return Ok((body, &[])) };
    let length = value
        .to_str()
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .ok_or_else(|| Refusal::invalid(format!("header {HEADER} is not a byte count")))?;
    if length > body.len() {
        return Err(Refusal::invalid(format!(
            "header {HEADER} is {length}, but the body has only {} bytes",
            body.len()
        )));
    }
    Ok(body.split_at(length))
}

fn binary_size(parameters: Option<&Map<String, Value>>) -> Option<&Value> {
    parameters?.get("binary_data_size")
}

/// Gives each input that declares `binary_data_size` its elements from `binary`, as JSON values,
/// so that the protocol's own checks (shape, datatype, ranges) apply to them unchanged.
pub fn attach(inputs: &mut [RawTensor], binary: &[u8]) -> Result<(), Refusal> {
    let mut at = 0usize;
    for (i, input) in inputs.iter_mut().enumerate() {
        let Some(size) = binary_size(input.parameters.as_ref()) else { continue };
        let here = |what: String| Refusal::invalid(format!("inputs[{i}] ('{}'): {what}", input.name));
        let size = size.as_u64().ok_or_else(|| here(format!("binary_data_size {size} is not a byte count")))? as usize;
        let Some(bytes) = binary.get(at..at + size) else {
            return Err(here(format!(
                "binary_data_size is {size}, but only {} bytes of binary data are left",
                binary.len() - at
            )));
        };
        at += size;
        let datatype = DataType::parse(&input.datatype)
            .ok_or_else(|| here(format!("datatype '{}' is not an Open Inference Protocol datatype", input.datatype)))?;
        input.data = Value::Array(decode(datatype, bytes).map_err(here)?);
    }
    if at != binary.len() {
        return Err(Refusal::invalid(format!(
            "{} bytes of binary data follow the JSON, but the inputs' binary_data_size add up to {at}",
            binary.len()
        )));
    }
    Ok(())
}

/// Bytes per element; `None` for BYTES, whose elements carry their own lengths.
fn width(datatype: DataType) -> Option<usize> {
    Some(match datatype {
        DataType::Bytes => return None,
        DataType::Bool | DataType::Uint8 | DataType::Int8 => 1,
        DataType::Uint16 | DataType::Int16 | DataType::Fp16 => 2,
        DataType::Uint32 | DataType::Int32 | DataType::Fp32 => 4,
        DataType::Uint64 | DataType::Int64 | DataType::Fp64 => 8,
    })
}

fn decode(datatype: DataType, bytes: &[u8]) -> Result<Vec<Value>, String> {
    let Some(width) = width(datatype) else { return decode_bytes(bytes) };
    if !bytes.len().is_multiple_of(width) {
        return Err(format!("{} bytes of {} data are not a whole number of elements", bytes.len(), datatype.name()));
    }
    let float = |x: f64| Number::from_f64(x).map(Value::Number).ok_or_else(|| format!("{x} is not a finite number"));
    bytes
        .chunks_exact(width)
        .map(|b| {
            let mut le = [0u8; 8];
            le[..width].copy_from_slice(b);
            Ok(match datatype {
                DataType::Bool => Value::Bool(b[0] != 0),
                DataType::Uint8 | DataType::Uint16 | DataType::Uint32 | DataType::Uint64 => {
                    Value::from(u64::from_le_bytes(le))
                }
                DataType::Int8 => Value::from(i64::from(b[0] as i8)),
                DataType::Int16 => Value::from(i64::from(i16::from_le_bytes([b[0], b[1]]))),
                DataType::Int32 => Value::from(i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
                DataType::Int64 => Value::from(i64::from_le_bytes(le)),
                DataType::Fp16 => float(half::f16::from_le_bytes([b[0], b[1]]).to_f64())?,
                DataType::Fp32 => float(f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]])))?,
                DataType::Fp64 => float(f64::from_le_bytes(le))?,
                DataType::Bytes => unreachable!("handled above"),
            })
        })
        .collect()
}

fn decode_bytes(mut bytes: &[u8]) -> Result<Vec<Value>, String> {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        let k = out.len();
        let (len, rest) =
            bytes.split_first_chunk::<4>().ok_or_else(|| format!("BYTES element {k} has a cut length"))?;
        let len = u32::from_le_bytes(*len) as usize;
        let element = rest.get(..len).ok_or_else(|| format!("BYTES element {k} is cut short"))?;
        let text = std::str::from_utf8(element).map_err(|_| format!("BYTES element {k} is not UTF-8 text"))?;
        out.push(Value::String(text.to_owned()));
        bytes = &rest[len..];
    }
    Ok(out)
}

/// A tensor's elements in the binary encoding.
pub fn encode(t: &Tensor) -> Vec<u8> {
    let mut out = Vec::new();
    match &t.data {
        TensorData::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
        TensorData::Bytes(v) => {
            for s in v {
                out.extend_from_slice(&(s.len() as u32).to_le_bytes());
                out.extend_from_slice(s.as_bytes());
            }
        }
        TensorData::Int(v) => {
            let width = width(t.datatype).unwrap_or(8);
            for &x in v {
                out.extend_from_slice(&(x as i64).to_le_bytes()[..width]);
            }
        }
        TensorData::Float(v) => {
            for &x in v {
                match t.datatype {
                    DataType::Fp16 => out.extend_from_slice(&half::f16::from_f64(x).to_le_bytes()),
                    DataType::Fp64 => out.extend_from_slice(&x.to_le_bytes()),
                    _ => out.extend_from_slice(&(x as f32).to_le_bytes()),
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{parse_inputs, InferRequest};
    use serde_json::json;

    fn request(json: Value) -> Vec<RawTensor> {
        serde_json::from_value::<InferRequest>(json).unwrap().inputs
    }

    #[test]
    fn bytes_and_numbers_round_trip() {
        let text = Tensor {
            name: "t".into(),
            datatype: DataType::Bytes,
            shape: vec![2],
            data: TensorData::Bytes(vec!["héllo".into(), "".into()]),
        };
        let floats = Tensor {
            name: "f".into(),
            datatype: DataType::Fp32,
            shape: vec![2, 1],
            data: TensorData::Float(vec![0.5, -2.0]),
        };
        let (tb, fb) = (encode(&text), encode(&floats));
        assert_eq!(tb, [&6u32.to_le_bytes()[..], "héllo".as_bytes(), &0u32.to_le_bytes()].concat());
        let mut raw = request(json!({"inputs": [
            {"name": "t", "datatype": "BYTES", "shape": [2], "parameters": {"binary_data_size": tb.len()}},
            {"name": "f", "datatype": "FP32", "shape": [2, 1], "parameters": {"binary_data_size": fb.len()}}
        ]}));
        attach(&mut raw, &[tb, fb].concat()).unwrap();
        let (tensors, rows) = parse_inputs(raw, 8).unwrap();
        assert_eq!((tensors, rows), (vec![text, floats], 2));
    }

    #[test]
    fn sizes_must_add_up() {
        let mut raw = request(json!({"inputs": [
            {"name": "f", "datatype": "FP32", "shape": [1], "parameters": {"binary_data_size": 4}}
        ]}));
        let err = attach(&mut raw, &[0; 3]).unwrap_err();
        assert!(err.message.contains("binary_data_size is 4, but only 3 bytes"), "{err}");
        let err = attach(&mut raw, &[0; 6]).unwrap_err();
        assert!(
            err.message
                .contains("6 bytes of binary data follow the JSON, but the inputs' binary_data_size add up to 4"),
            "{err}"
        );
        let mut raw = request(json!({"inputs": [
            {"name": "t", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 6}}
        ]}));
        let err = attach(&mut raw, &[9, 0, 0, 0, b'a', b'b']).unwrap_err();
        assert!(err.message.contains("BYTES element 0 is cut short"), "{err}");
    }

    #[test]
    fn the_header_splits_the_body() {
        let mut headers = HeaderMap::new();
        assert_eq!(split(&headers, b"{}xyz").unwrap(), (&b"{}xyz"[..], &b""[..]));
        headers.insert(HEADER, "2".parse().unwrap());
        assert_eq!(split(&headers, b"{}xyz").unwrap(), (&b"{}"[..], &b"xyz"[..]));
        headers.insert(HEADER, "99".parse().unwrap());
        assert!(split(&headers, b"{}").unwrap_err().message.contains("the body has only 2 bytes"));
    }
}
