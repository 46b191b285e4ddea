//! Calibration of the KV cache's global scales: the largest |K| and |V| each layer produces on
//! sample text, turned into per-(layer, K|V) dequantization multipliers.
//!
//! For NVFP4 the scale maps the layer's amax onto the largest block scale, `amax / (6 · 448)`,
//! so no block scale saturates; for FP8 it maps amax onto the largest E4M3 value, `amax / 448`.
//! BF16 needs none. A layer whose K or V is all zero gets 1.0. The JSON file records the amax
//! values and the scales for both dtypes, so one calibration serves either cache.

use serde::{Deserialize, Serialize};

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::kv::{ContiguousKv, KvBatch, KvStore, NewTokens, StepTokens};
use crate::model::{Logits, Model};
use nibble_kvcache::GlobalScales;
use nibble_kvfmt::KvDtype;

/// Largest finite E4M3 value.
const E4M3_MAX: f32 = 448.0;
/// Largest E2M1 value.
const E2M1_MAX: f32 = 6.0;

/// Per-layer amax of K (after RoPE) and V.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    /// What the numbers were measured on, for the record.
    pub source: String,
    /// Tokens that went through the model.
    pub tokens: usize,
    pub k_amax: Vec<f32>,
    pub v_amax: Vec<f32>,
}

impl Calibration {
    /// The global scales for a `dtype` cache.
    pub fn scales(&self, dtype: KvDtype) -> GlobalScales {
        let divisor = match dtype {
            KvDtype::Nvfp4 => E2M1_MAX * E4M3_MAX,
            KvDtype::Fp8 => E4M3_MAX,
            KvDtype::Bf16 => return GlobalScales::ones(self.k_amax.len()),
        };
        let scale = |amax: &f32| {
            if *amax > 0.0 && amax.is_finite() {
                amax / divisor
            } else {
                1.0
            }
        };
        GlobalScales {
            k: self.k_amax.iter().map(scale).collect(),
            v: self.v_amax.iter().map(scale).collect(),
        }
    }

    /// The JSON file's contents: amax values plus the derived scales of both quantized dtypes.
    pub fn to_json(&self) -> Result<String> {
        let file = CalibrationFile {
            source: self.source.clone(),
            tokens: self.tokens,
            k_amax: self.k_amax.clone(),
            v_amax: self.v_amax.clone(),
            nvfp4: self.scales(KvDtype::Nvfp4),
            fp8: self.scales(KvDtype::Fp8),
        };
        serde_json::to_string_pretty(&file)
            .map_err(|e| Error::InvalidInput(format!("serializing calibration: {e}")))
    }

    /// Reads a calibration file, checking it has one K and one V value per layer.
    pub fn from_json(text: &str, layers: usize) -> Result<Self> {
        let file: CalibrationFile = serde_json::from_str(text)
            .map_err(|e| Error::InvalidInput(format!("calibration file: {e}")))?;
        if file.k_amax.len() != layers || file.v_amax.len() != layers {
            return Err(Error::InvalidInput(format!(
                "calibration file has {} K and {} V values; the model has {layers} layers",
                file.k_amax.len(),
                file.v_amax.len()
            )));
        }
        if let Some(bad) = file
            .k_amax
            .iter()
            .chain(&file.v_amax)
            .find(|x| !x.is_finite() || **x < 0.0)
        {
            return Err(Error::InvalidInput(format!(
                "calibration file: amax {bad} is not a finite non-negative number"
            )));
        }
        Ok(Self {
            source: file.source,
            tokens: file.tokens,
            k_amax: file.k_amax,
            v_amax: file.v_amax,
        })
    }
}

#[derive(Serialize, Deserialize)]
struct CalibrationFile {
    source: String,
    tokens: usize,
    k_amax: Vec<f32>,
    v_amax: Vec<f32>,
    nvfp4: GlobalScales,
    fp8: GlobalScales,
}

/// A single-sequence f32 cache that records every layer's amax as K and V pass through.
struct Recorder<'a, B: Backend> {
    kv: &'a mut ContiguousKv<B>,
    k_amax: Vec<f32>,
    v_amax: Vec<f32>,
    host: Vec<f32>,
}

impl<B: Backend> KvBatch<B> for Recorder<'_, B> {
    fn sequences(&self) -> usize {
        1
    }

    fn stored(&self, _seq: usize) -> usize {
        self.kv.len()
    }

    fn reserve(&mut self, backend: &B, new: &[usize]) -> Result<()> {
        self.kv.reserve(backend, new[0])
    }

    fn attend(
        &mut self,
        backend: &B,
        layer: usize,
        step: &StepTokens<'_, B::Tensor>,
        out: &mut B::Tensor,
    ) -> Result<()> {
        let rows = step.spans[0].clone();
        for (tensor, amax) in [
            (step.k, &mut self.k_amax[layer]),
            (step.v, &mut self.v_amax[layer]),
        ] {
            self.host.clear();
            backend.download_rows(tensor, rows.clone(), &mut self.host);
            *amax = self.host.iter().fold(*amax, |m, x| m.max(x.abs()));
        }
        let new = NewTokens {
            q: step.q,
            k: step.k,
            v: step.v,
            rows,
            geometry: step.geometry,
        };
        self.kv.attend(backend, layer, &new, out)
    }

    fn commit(&mut self, new: &[usize]) {
        self.kv.commit(new[0]);
    }
}

/// Runs `tokens` through `model` in windows of `window` tokens and records every layer's amax.
pub fn calibrate<B: Backend>(
    model: &Model<B>,
    tokens: &[u32],
    window: usize,
    source: &str,
) -> Result<Calibration> {
    if tokens.is_empty() || window == 0 {
        return Err(Error::InvalidInput(
            "calibration needs at least one token and a positive window".into(),
        ));
    }
    let layers = model.config().num_layers;
    let mut ws = model.workspace();
    let mut logits = Vec::new();
    let (mut k_amax, mut v_amax) = (vec![0.0f32; layers], vec![0.0f32; layers]);
    for chunk in tokens.chunks(window) {
        let mut kv = model.new_kv(chunk.len());
        let mut recorder = Recorder {
            kv: &mut kv,
            k_amax,
            v_amax,
            host: Vec::new(),
        };
        model.forward_batch(&mut ws, &[chunk], &mut recorder, Logits::None, &mut logits)?;
        k_amax = recorder.k_amax;
        v_amax = recorder.v_amax;
    }
    Ok(Calibration {
        source: source.to_string(),
        tokens: tokens.len(),
        k_amax,
        v_amax,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scales_map_amax_to_the_format_maximum() {
        let c = Calibration {
            source: "test".into(),
            tokens: 10,
            k_amax: vec![2688.0, 0.0],
            v_amax: vec![4.48, 1.0],
        };
        let nvfp4 = c.scales(KvDtype::Nvfp4);
        assert_eq!(nvfp4.k, vec![1.0, 1.0]);
        let fp8 = c.scales(KvDtype::Fp8);
        assert_eq!(fp8.k[0], 6.0);
        assert!((fp8.v[0] - 0.01).abs() < 1e-7);
        let json = c.to_json().unwrap();
        assert_eq!(Calibration::from_json(&json, 2).unwrap(), c);
        let err = Calibration::from_json(&json, 3).unwrap_err();
        assert!(err.to_string().contains("model has 3 layers"), "{err}");
        assert!(Calibration::from_json("{", 2).is_err());
    }
}
