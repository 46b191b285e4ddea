//! A hand-off whose decode worker already holds every page of the prompt: a prompt of whole
//! pages, cached on the decode worker by an earlier hand-off, in a K/V format without a recent
//! window (fp8, bf16). The reservation awaits no page, so the prefill worker pushes none and
//! the decode worker decodes from its cache. (The chaos test found it: the prefill worker used
//! to open a push of no message, which the decode worker refuses, and the request failed.)

mod support;

use std::sync::Arc;

use nibble_engine::scheduler::SchedulerConfig;
use nibble_engine::{EngineConfig, KvConfig};
use nibble_kvfmt::KvDtype;
use nibble_proto::v1;
use nibble_testkit::{handoff, model, Handoff, WorkerApi};
use nibble_worker::EngineHandle;
use support::Server;

/// Two whole pages of 16 tokens.
const PROMPT_TOKENS: usize = 32;

fn engine(dtype: KvDtype) -> EngineHandle {
    let (model, tokenizer) = model();
    let kv = KvConfig::new(dtype);
    let page_bytes = kv.layout(model).unwrap().page_bytes();
    let config = EngineConfig {
        kv,
        kv_budget_bytes: 64 * page_bytes,
        scheduler: SchedulerConfig::default(),
    };
    EngineHandle::spawn(model.clone(), Arc::clone(tokenizer), config).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_holding_the_whole_prompt_is_sent_no_page() {
    let text = "It is a truth universally acknowledged, that a single man in possession of a \
                good fortune, must be in want of a wife. However little known the feelings or \
                views of such a man may be on his first entering a neighbourhood";
    let prompt = model().1.encode(text, false).unwrap()[..PROMPT_TOKENS].to_vec();
    let stopping = v1::StoppingCriteria {
        max_tokens: Some(6),
        ignore_eos: true,
        ..Default::default()
    };
    for dtype in [KvDtype::Bf16, KvDtype::Fp8] {
        let p = Server::start(engine(dtype), v1::WorkerRole::Prefill, "p".into()).await;
        let d = Server::start(engine(dtype), v1::WorkerRole::Decode, "d".into()).await;
        let cold = handoff(&p, &d, "cold", &prompt, stopping.clone()).await;
        assert_eq!(cold.reservation.cached_tokens, 0, "{dtype}");
        let Handoff {
            tokens,
            reservation,
            transfer,
            ..
        } = handoff(&p, &d, "warm", &prompt, stopping.clone()).await;
        assert_eq!(
            reservation.cached_tokens as usize, PROMPT_TOKENS,
            "{dtype}: the decode worker cached the whole prompt"
        );
        assert_eq!(reservation.page_count, 0, "{dtype}");
        assert_eq!(transfer.pages, 0, "{dtype}");
        // The cached pages are the bytes the prefill worker sent the first time.
        assert_eq!(tokens, cold.tokens, "{dtype}");
        for w in [&p, &d] {
            let load = w.pages_back().await;
            assert_eq!(load.pending_reservations, 0, "{dtype}");
        }
    }
}
