"""A dev server around FakeEngine in its own process, for fault-injection tests (real SIGKILL and SIGSTOP, restarts
on the same port):

    python tests/engines/fake_devserver.py --port P [--step-s S] [--update-delay-s D] [--poisoned] [--api-key K]
        [--admin-api-key K]
"""

import argparse
import asyncio

from engine_fakes import FakeEngine

from ipa_jax.engines.devserver import DevServer, serve_until_signal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--step-s", type=float, default=0.0, help="seconds per generated token")
    parser.add_argument("--update-delay-s", type=float, default=0.0, help="seconds a weight update takes")
    parser.add_argument("--poisoned", action="store_true", help="positive log-probs: every trajectory is invalid")
    parser.add_argument("--api-key", default="")
    parser.add_argument("--admin-api-key", default="")
    args = parser.parse_args()
    engine = FakeEngine(step_s=args.step_s, update_delay_s=args.update_delay_s, poisoned=args.poisoned)
    asyncio.run(
        serve_until_signal(
            DevServer(engine, port=args.port, api_key=args.api_key or None, admin_api_key=args.admin_api_key or None)
        )
    )


if __name__ == "__main__":
    main()
