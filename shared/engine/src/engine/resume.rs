//! Resuming a request another engine started and could not finish (its decode worker died
//! mid-stream): its output so far is known and was streamed to its client, who must not get it
//! again, and the next tokens must be those an undisturbed run gives.
//!
//! The prompt is computed as any prompt is (in blocks here, or over a reservation a prefill
//! worker filled) and the output one token at a time through the decode path, as it was first
//! computed, without sampling ([`NewRequest::output`]): its K/V, and so under greedy decoding
//! every later token, are those of the undisturbed run. Everything else the request carries is
//! brought to where it was after that output: the penalties see it (they read the sequence's
//! tokens), its constraint is replayed over it ([`Grammar::start`](crate::grammar::Grammar)),
//! its random stream is as many draws on ([`Sampler::skip_draws`]), the detokenizer and the
//! stop-string matcher have taken its text (what they held back the client has not seen; it
//! comes with the next tokens), and it counts as completion tokens and toward `max_tokens`.

use super::{
    Backend, Engine, Event, FinishReason, NewRequest, Request, RequestError, SamplingParams, SeqId,
    StopStep, SubmitError,
};

/// How a resumed request's output already ended it, if it did: the reason, and whether the
/// text held back is still to be sent (not after a stop string, which drops it).
type Ended = Option<(FinishReason, bool)>;

impl<B: Backend> Engine<B> {
    /// Queues a request resumed after `output` (the tokens another engine generated and
    /// streamed; not empty), computing its prompt here. Returns the events of its end when that
    /// output already ends it (nothing is queued then); else its next tokens come from
    /// [`step`](Self::step) as usual, never the output's own.
    pub fn submit_resumed(
        &mut self,
        id: SeqId,
        prompt: Vec<u32>,
        output: &[u32],
        params: SamplingParams,
    ) -> Result<Vec<Event>, RequestError> {
        self.check_tokens(&prompt)?;
        let (request, stop_tokens, ended) = self.resumed(id, &prompt, output, &params)?;
        if self.requests.contains_key(&id) {
            return Err(SubmitError::Duplicate(id).into());
        }
        if let Some((reason, flush)) = ended {
            self.requests.insert(id, request);
            return Ok(vec![self.close(id, reason, None, flush)]);
        }
        self.state.submit(NewRequest {
            id,
            prompt,
            max_tokens: params.max_tokens as usize,
            stop_tokens,
            prefill_only: false,
            reuse_prefix: true,
            output: output.to_vec(),
        })?;
        self.requests.insert(id, request);
        Ok(Vec::new())
    }

    /// Starts decoding a filled reservation (its prompt's pages from a prefill worker) of a
    /// request resumed after `output`, as [`submit_resumed`](Self::submit_resumed) does; the
    /// prefill worker's first token is not used (`output` starts with the one the client got).
    pub fn resume_decode(
        &mut self,
        id: SeqId,
        output: &[u32],
        params: SamplingParams,
    ) -> Result<Vec<Event>, RequestError> {
        let prompt = (self.state.tokens(id))
            .ok_or(SubmitError::Unknown(id))?
            .to_vec();
        let (mut request, stop_tokens, ended) = self.resumed(id, &prompt, output, &params)?;
        request.cached_tokens = self.state.prefix_hit(id);
        let ended = match ended {
            Some(ended) => {
                self.state.release_held(id);
                Some(ended)
            }
            None => {
                let max_tokens = params.max_tokens as usize;
                (self.state.activate(id, output, max_tokens, stop_tokens)?)
                    .map(|reason| (reason, true))
            }
        };
        self.requests.insert(id, request);
        Ok(match ended {
            Some((reason, flush)) => vec![self.close(id, reason, None, flush)],
            None => Vec::new(),
        })
    }

    /// A resumed request's state after `output`, its stop tokens, and how that output already
    /// ended it, if it did.
    fn resumed(
        &self,
        id: SeqId,
        prompt: &[u32],
        output: &[u32],
        params: &SamplingParams,
    ) -> Result<(Request, Vec<u32>, Ended), RequestError> {
        params.validate()?;
        params.check_not_scoring()?;
        self.check_tokens(output)?;
        let Some(&last) = output.last() else {
            return Err(SubmitError::EmptyOutput(id).into());
        };
        if output.len() > params.max_tokens as usize {
            return Err(SubmitError::Finished(id).into());
        }
        let stop_tokens = self.stop_tokens(params);
        let mut request = Request::new(prompt, params, self.sampler(params, output)?);
        request.completion_tokens = output.len();
        let skip = request.skip_special;
        let decode = |ids: &[u32]| self.tokenizer.decode(ids, skip);
        // The text as the first engine streamed it (see `Engine::emit`).
        for &token in output {
            let delta = match !skip && stop_tokens.contains(&token) {
                true => String::new(),
                false => request.detok.push(token, decode).unwrap_or_default(),
            };
            if let StopStep::Stop(_) = request.stop.push(&delta) {
                // Only its last token can have met a stop string: the stream ended there.
                return Ok((request, stop_tokens, Some((FinishReason::Stop, false))));
            }
        }
        let ended = if stop_tokens.contains(&last) {
            Some((FinishReason::Stop, true))
        } else if output.len() >= params.max_tokens as usize {
            Some((FinishReason::Length, true))
        } else {
            None
        };
        Ok((request, stop_tokens, ended))
    }
}
