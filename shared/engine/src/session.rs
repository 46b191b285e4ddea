//! Running one sequence over the paged cache without the scheduler: evaluation, calibration and
//! tests drive the three attention paths directly with this.

use nibble_kvcache::{GlobalScales, PageId, PagePool, PageTable, PoolPlan};
use std::sync::Arc;

use nibble_kvfmt::nvfp4::feedback::KeyFactors;
use nibble_kvfmt::{KvDtype, PageLayout, ScaleRule, WindowLayout};

use crate::backend::{Backend, PageEncoding, PagedSeq};
use crate::calibrate::{Calibration, KSmoothing};
use crate::error::{Error, Result};
use crate::kv::PagedBatch;
use crate::model::{Logits, Model, Workspace};
use crate::paged::WorkDtype;

/// How a model's KV cache is stored.
#[derive(Debug, Clone, PartialEq)]
pub struct KvConfig {
    pub dtype: KvDtype,
    /// Tokens per page.
    pub page_size: usize,
    /// Per-(layer, K|V) dequantization multipliers; the dtype's uncalibrated ones
    /// ([`GlobalScales::uncalibrated`]) when `None`.
    pub scales: Option<GlobalScales>,
    /// Per-channel K smoothing the model applies before K reaches the cache (the model is
    /// prepared with [`Model::with_k_smoothing`]); `scales` must then be of the smoothed K.
    pub k_smoothing: Option<KSmoothing>,
    /// Store head vectors rotated by the normalized Hadamard matrix.
    pub hadamard: bool,
    /// How NVFP4 block scales are chosen on write (readers need not know).
    pub scale_rule: ScaleRule,
    /// K's NVFP4 codes chosen for the queries that read them, one factor per layer and KV head
    /// (a calibration's, [`Self::with_k_codes`]); `None`: the nearest codes.
    pub k_codes: Option<Arc<KeyFactors>>,
    /// Tokens of each sequence's high-precision recent window, kept in BF16 besides the pages
    /// (0: none; a multiple of `page_size`).
    pub window: usize,
    /// The dtype prefill and extend attention hold K/V in (`--prefill-work`); the default
    /// ([`WorkDtype::default`], BF16) when `None`. A bf16 cache takes only BF16
    /// ([`WorkDtype::check_cache`]).
    pub prefill_work: Option<WorkDtype>,
}

impl KvConfig {
    /// `dtype` pages of 16 tokens, uncalibrated, no rotation, the default scale rule and window.
    pub fn new(dtype: KvDtype) -> Self {
        Self {
            dtype,
            page_size: 16,
            scales: None,
            k_smoothing: None,
            hadamard: false,
            scale_rule: ScaleRule::default(),
            k_codes: None,
            window: Self::default_window(dtype, 16),
            prefill_work: None,
        }
    }

    /// The recent window a `dtype` cache of `page_size`-token pages gets unless told otherwise:
    /// for nvfp4, whose error is mostly in the keys nearest the query, 48 tokens rounded up to
    /// whole pages (48 for pages of 16, 64 for 32 or 64; docs/ACCURACY.md: at 48 it is level
    /// with or better than FP8, and holds 1.7x FP8's tokens from 4K contexts); none for fp8
    /// and bf16.
    pub fn default_window(dtype: KvDtype, page_size: usize) -> usize {
        match dtype {
            KvDtype::Nvfp4 => 48usize.div_ceil(page_size.max(1)) * page_size.max(1),
            KvDtype::Fp8 | KvDtype::Bf16 => 0,
        }
    }

    /// The same config with `calibration`'s global scales, and with K smoothed by its channel
    /// amax when `smooth_k` and the calibration measured them (a file written before `nibble
    /// calibrate` measured channels cannot smooth). The scales are those of what the cache
    /// holds: smoothed K, and rotated K/V when `hadamard` is set (set it first). Fails when a
    /// rotated cache's calibration has no amax of rotated vectors.
    pub fn with_calibration(mut self, calibration: &Calibration, smooth_k: bool) -> Result<Self> {
        self.k_smoothing = calibration.smoothing().filter(|_| smooth_k);
        self.scales =
            Some(calibration.scales_for(self.dtype, self.k_smoothing.as_ref(), self.hadamard)?);
        Ok(self)
    }

    /// The same config with K's codes chosen for the queries `calibration` measured, when `on`,
    /// the cache is nvfp4 and the calibration has the queries' second moment (files written
    /// before `nibble calibrate` measured it have none: the nearest codes then). Call it after
    /// [`Self::with_calibration`] and with `hadamard` set: the factors follow K's smoothing and
    /// rotation. Fails when the second moment does not fit the model's heads.
    pub fn with_k_codes(
        mut self,
        calibration: &Calibration,
        head_dim: usize,
        on: bool,
    ) -> Result<Self> {
        self.k_codes = match (on, self.dtype) {
            (true, KvDtype::Nvfp4) => calibration
                .query_factors(head_dim, self.k_smoothing.as_ref(), self.hadamard)?
                .map(Arc::new),
            _ => None,
        };
        Ok(self)
    }

    /// A digest of the factors K's codes are chosen with, for the KV-format fingerprint (two
    /// workers pair only if they write the same bytes for the same tokens); `None` without.
    pub fn k_codes_digest(&self) -> Option<u64> {
        self.k_codes
            .as_ref()
            .map(|f| crate::calibrate::f32_digest(f.uppers().flatten()))
    }

    /// The window a `dtype` cache of `page_size`-token pages gets: `flag`'s, else the one
    /// `calibration` names for its model ([`Calibration::window_for`]), else
    /// [`Self::default_window`]. The flag says whether the calibration chose it, so that an
    /// error about the window names the file.
    pub fn chosen_window(
        dtype: KvDtype,
        page_size: usize,
        flag: Option<usize>,
        calibration: Option<&Calibration>,
    ) -> (usize, bool) {
        match (flag, calibration.and_then(|c| c.window_for(dtype))) {
            (Some(tokens), _) => (tokens, false),
            (None, Some(tokens)) => (tokens, true),
            (None, None) => (Self::default_window(dtype, page_size), false),
        }
    }

    /// The same config with a window of `tokens` tokens (`None`: the dtype's default).
    pub fn with_window(mut self, tokens: Option<usize>) -> Self {
        self.window = tokens.unwrap_or(Self::default_window(self.dtype, self.page_size));
        self
    }

    /// The window's geometry over `layout`'s pages, or an error naming what does not fit.
    pub fn window_layout(&self, layout: &PageLayout) -> Result<WindowLayout> {
        Ok(WindowLayout::new(layout, self.window).map_err(nibble_kvcache::Error::from)?)
    }

    /// How a pool of `layers` layers under this config encodes its pages.
    pub fn encoding(&self, layers: usize) -> Result<PageEncoding> {
        Ok(PageEncoding {
            scales: self.scales_for(layers)?,
            hadamard: self.hadamard,
            scale_rule: self.scale_rule,
            k_codes: self.k_codes.clone(),
            window: self.window,
            prefill_work: self.work(),
        })
    }

    /// The dtype prefill and extend attention hold K/V in: `prefill_work`, else the default.
    pub fn work(&self) -> WorkDtype {
        self.prefill_work.unwrap_or_default()
    }

    /// The page layout of `model` under this config.
    pub fn layout<B: Backend>(&self, model: &Model<B>) -> Result<PageLayout> {
        let c = model.config();
        Ok(PageLayout::new(
            c.num_layers,
            c.num_kv_heads,
            c.head_dim,
            self.page_size,
            self.dtype,
        )
        .map_err(nibble_kvcache::Error::from)?)
    }

    /// The global scales to use for `layers` layers.
    pub fn scales_for(&self, layers: usize) -> Result<GlobalScales> {
        match &self.scales {
            Some(s) if s.k.len() == layers && s.v.len() == layers => Ok(s.clone()),
            Some(s) => Err(Error::InvalidInput(format!(
                "calibration has {} K and {} V scales, the model has {layers} layers",
                s.k.len(),
                s.v.len()
            ))),
            None => Ok(GlobalScales::uncalibrated(self.dtype, layers)),
        }
    }
}

/// One sequence's pages, its window's pages, pool and page bytes.
pub struct PagedSession<B: Backend> {
    pool: PagePool,
    pages: B::Pages,
    table: PageTable,
    window: Vec<PageId>,
}

impl<B: Backend> PagedSession<B> {
    /// A session with room for `tokens` tokens of `model`.
    pub fn new(model: &Model<B>, kv: &KvConfig, tokens: usize) -> Result<Self> {
        let layout = kv.layout(model)?;
        let window = kv.window_layout(&layout)?;
        let token_pages = tokens.div_ceil(kv.page_size).max(1);
        let plan = PoolPlan::for_pages(layout, token_pages + window.pages())?;
        let mut pool = PagePool::new(plan);
        let window = pool.alloc(window.pages())?;
        Ok(Self {
            pages: model
                .backend()
                .new_pages(plan, kv.encoding(layout.layers())?)?,
            pool,
            table: PageTable::new(),
            window,
        })
    }

    /// Tokens stored.
    pub fn len(&self) -> usize {
        self.table.len()
    }

    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// Runs `tokens` after what is stored: initial prefill when empty, decode for one token,
    /// extend otherwise.
    pub fn forward(
        &mut self,
        model: &Model<B>,
        ws: &mut Workspace<B>,
        tokens: &[u32],
        which: Logits<'_>,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        let stored = self.table.len();
        let mut table = self.table.clone();
        let slots = table.append(&mut self.pool, tokens.len())?;
        let mut batch = PagedBatch::<B> {
            pages: &mut self.pages,
            pool: &self.pool,
            seqs: vec![PagedSeq {
                pages: table.pages(),
                stored,
                slots: &slots,
                window: &self.window,
            }],
        };
        let result = model.forward_batch(ws, &[tokens], &mut batch, which, logits);
        match result {
            Ok(()) => {
                self.table = table;
                Ok(())
            }
            Err(e) => {
                // Give back the pages this step allocated.
                let new = &table.pages()[self.table.pages().len()..];
                self.pool.release_all(new)?;
                Err(e)
            }
        }
    }
}
