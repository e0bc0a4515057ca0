"""R³: SERR ranking rewards, CCR replay, ISR reflection prompts, the policy loss and the train step."""
