//! Stop strings over streamed text.
//!
//! Text arrives in deltas as tokens are decoded. [`StopMatcher::push`] returns the text that is
//! safe to send: everything up to a stop string when one completes (the stop string itself is not
//! sent), and otherwise everything except a tail that could still grow into a stop string. Held
//! back text is released by [`StopMatcher::finish`] when generation ends for another reason.

/// What the caller does after a delta.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopStep {
    /// Send this text and go on.
    Continue(String),
    /// Send this text; a stop string was found and generation ends.
    Stop(String),
}

/// Watches streamed text for stop strings.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    text: String,
    /// Bytes of `text` already released.
    sent: usize,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops,
            text: String::new(),
            sent: 0,
        }
    }

    /// Adds a delta and returns what may be sent.
    pub fn push(&mut self, delta: &str) -> StopStep {
        self.text.push_str(delta);
        if self.stops.is_empty() {
            return StopStep::Continue(self.release(self.text.len()));
        }
        // Only unsent text can hold a stop string: sent text never ended in a prefix of one.
        let earliest = self
            .stops
            .iter()
            .filter_map(|stop| self.text[self.sent..].find(stop.as_str()))
            .min();
        if let Some(at) = earliest {
            let end = self.sent + at;
            let out = self.release(end);
            self.sent = self.text.len();
            return StopStep::Stop(out);
        }
        let hold = self.partial_tail();
        StopStep::Continue(self.release(self.text.len() - hold))
    }

    /// Releases everything held back (generation ended without a stop string).
    pub fn finish(&mut self) -> String {
        self.release(self.text.len())
    }

    /// Length of the longest tail of the unsent text that is a proper prefix of a stop string.
    fn partial_tail(&self) -> usize {
        let unsent = &self.text[self.sent..];
        let mut longest = 0;
        for stop in &self.stops {
            for (i, _) in stop.char_indices().skip(1) {
                if i > longest && unsent.ends_with(&stop[..i]) {
                    longest = i;
                }
            }
        }
        longest
    }

    fn release(&mut self, end: usize) -> String {
        let out = self.text[self.sent..end].to_string();
        self.sent = end;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], deltas: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for d in deltas {
            match m.push(d) {
                StopStep::Continue(s) => out.push_str(&s),
                StopStep::Stop(s) => {
                    out.push_str(&s);
                    return (out, true);
                }
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn stops_before_the_stop_string_across_deltas() {
        assert_eq!(
            run(&["END"], &["hello E", "N", "D more"]),
            ("hello ".into(), true)
        );
        assert_eq!(run(&["\n\n"], &["a\n", "\nb"]), ("a".into(), true));
    }

    #[test]
    fn holds_back_only_possible_prefixes() {
        let mut m = StopMatcher::new(vec!["STOP".into()]);
        assert_eq!(m.push("abcST"), StopStep::Continue("abc".into()));
        assert_eq!(m.push("x"), StopStep::Continue("STx".into()));
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn earliest_stop_wins_and_no_stop_releases_all() {
        assert_eq!(run(&["b", "a"], &["xxab"]), ("xx".into(), true));
        assert_eq!(run(&["zz"], &["abc", "z"]), ("abcz".into(), false));
        assert_eq!(run(&[], &["ab", "c"]), ("abc".into(), false));
    }

    #[test]
    fn multibyte_text_is_cut_on_char_boundaries() {
        assert_eq!(run(&["éé"], &["aé", "é"]), ("a".into(), true));
        assert_eq!(run(&["éx"], &["aé", "b"]), ("aéb".into(), false));
    }
}
