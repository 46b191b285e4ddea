//! Engine results to wire messages. The way in (request fields to the engine's sampling
//! parameters) is `nibble_proto::request`, shared with the router.

use nibble_engine::sampling::TokenLogprobs;
use nibble_engine::scheduler::FinishReason;
use nibble_proto::v1;

/// The wire finish reason. `Stop` is a stop string unless the last token is a stop token.
pub fn finish_reason(reason: FinishReason, stop_token: bool) -> v1::FinishReason {
    match reason {
        FinishReason::Length => v1::FinishReason::Length,
        FinishReason::Stop if stop_token => v1::FinishReason::StopToken,
        FinishReason::Stop => v1::FinishReason::StopString,
        FinishReason::Aborted => v1::FinishReason::Unspecified,
    }
}

/// The wire usage.
pub fn usage(u: &nibble_engine::Usage) -> v1::Usage {
    v1::Usage {
        prompt_tokens: u.prompt_tokens as u32,
        completion_tokens: u.completion_tokens as u32,
        cached_tokens: u.cached_tokens as u32,
    }
}

/// A chosen token's log-probability and its alternatives, when they were computed.
pub fn logprob(token: u32, logprobs: Option<TokenLogprobs>) -> Option<v1::TokenLogprob> {
    logprobs.map(|l| v1::TokenLogprob {
        token_id: token,
        logprob: l.logprob,
        top: l
            .top
            .into_iter()
            .map(|t| v1::TopLogprob {
                token_id: t.token,
                logprob: t.logprob,
            })
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_come_back() {
        let wire = logprob(
            7,
            Some(TokenLogprobs {
                logprob: -0.5,
                top: vec![nibble_engine::sampling::TopLogprob {
                    token: 7,
                    logprob: -0.5,
                }],
            }),
        )
        .unwrap();
        assert_eq!(wire.token_id, 7);
        assert_eq!(wire.logprob, -0.5);
        assert_eq!(
            wire.top,
            vec![v1::TopLogprob {
                token_id: 7,
                logprob: -0.5
            }]
        );
        assert_eq!(logprob(7, None), None);
    }
}
