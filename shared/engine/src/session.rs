//! Running one sequence over the paged cache without the scheduler: evaluation, calibration and
//! tests drive the three attention paths directly with this.

use nibble_kvcache::{GlobalScales, PagePool, PageTable, PoolPlan};
use nibble_kvfmt::{KvDtype, PageLayout, ScaleRule};

use crate::backend::{Backend, PageEncoding, PagedSeq};
use crate::error::{Error, Result};
use crate::kv::PagedBatch;
use crate::model::{Logits, Model, Workspace};

/// How a model's KV cache is stored.
#[derive(Debug, Clone, PartialEq)]
pub struct KvConfig {
    pub dtype: KvDtype,
    /// Tokens per page.
    pub page_size: usize,
    /// Per-(layer, K|V) dequantization multipliers; 1.0 everywhere when `None` (uncalibrated).
    pub scales: Option<GlobalScales>,
    /// Store head vectors rotated by the normalized Hadamard matrix.
    pub hadamard: bool,
    /// How NVFP4 block scales are chosen on write (readers need not know).
    pub scale_rule: ScaleRule,
}

impl KvConfig {
    /// `dtype` pages of 16 tokens, uncalibrated, no rotation, the default scale rule.
    pub fn new(dtype: KvDtype) -> Self {
        Self {
            dtype,
            page_size: 16,
            scales: None,
            hadamard: false,
            scale_rule: ScaleRule::default(),
        }
    }

    /// How a pool of `layers` layers under this config encodes its pages.
    pub fn encoding(&self, layers: usize) -> Result<PageEncoding> {
        Ok(PageEncoding {
            scales: self.scales_for(layers)?,
            hadamard: self.hadamard,
            scale_rule: self.scale_rule,
        })
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
            None => Ok(GlobalScales::ones(layers)),
        }
    }
}

/// One sequence's pages, pool and page bytes.
pub struct PagedSession<B: Backend> {
    pool: PagePool,
    pages: B::Pages,
    table: PageTable,
}

impl<B: Backend> PagedSession<B> {
    /// A session with room for `tokens` tokens of `model`.
    pub fn new(model: &Model<B>, kv: &KvConfig, tokens: usize) -> Result<Self> {
        let layout = kv.layout(model)?;
        let plan = PoolPlan::for_pages(layout, tokens.div_ceil(kv.page_size).max(1))?;
        Ok(Self {
            pool: PagePool::new(plan),
            pages: model
                .backend()
                .new_pages(plan, kv.encoding(layout.layers())?)?,
            table: PageTable::new(),
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
        which: Logits,
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
