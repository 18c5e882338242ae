"""`python -m reward.validate`: the documented command; the code lives in
reward.grading.validate."""

from reward.grading.validate import main

if __name__ == "__main__":
    raise SystemExit(main())
