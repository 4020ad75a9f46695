"""``duoserve-client``: generate, chat, tokenize, list models and check health from a shell.

Exit status: 0 on success; on a failed call, the gRPC status number (3 INVALID_ARGUMENT,
4 DEADLINE_EXCEEDED, 8 RESOURCE_EXHAUSTED, 14 UNAVAILABLE, ...) after printing
``error: <CODE>: <details>`` to stderr; 1 when ``health`` answers anything but SERVING;
2 for bad command-line usage; 130 when interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, TextIO

from duoserve_client._channel import DEFAULT_TARGET
from duoserve_client._security import tls_credentials
from duoserve_client.client import Client
from duoserve_client.errors import DuoserveError
from duoserve_client.results import Completion, CompletionChunk, Message

if TYPE_CHECKING:
    from duoserve_client._requests import GenerateOptions

API_KEY_ENV = "DUOSERVE_API_KEY"
TARGET_ENV = "DUOSERVE_TARGET"


def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="", help="model name (default: the server's only model)")
    parser.add_argument("--max-tokens", type=int, help="most tokens to generate")
    parser.add_argument("--temperature", type=float, help="0 = greedy (the default)")
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--min-p", type=float)
    parser.add_argument("--repetition-penalty", type=float)
    parser.add_argument("--presence-penalty", type=float)
    parser.add_argument("--frequency-penalty", type=float)
    parser.add_argument("--seed", type=int, help="seed for reproducible sampling")
    parser.add_argument("--stop", nargs="+", action="extend", metavar="STR", help="stop strings")
    parser.add_argument("--stop-token-ids", nargs="+", action="extend", type=int, metavar="ID")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    parser.add_argument("--logprobs", type=int, metavar="N", help="return logprobs with the top N")
    parser.add_argument(
        "--priority", choices=("interactive", "standard", "batch"), help="scheduling class (default standard)"
    )
    parser.add_argument("--deadline-ms", type=int, help="server-side deadline from arrival, in milliseconds")
    parser.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    parser.add_argument("--json", action="store_true", help="print JSON (one object per chunk with --stream)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``duoserve-client``."""
    parser = argparse.ArgumentParser(prog="duoserve-client", description="Talk to a duoserve server.")
    parser.add_argument(
        "--target",
        default=None,
        help=f"HOST:PORT of the server (default: ${TARGET_ENV} or {DEFAULT_TARGET})",
    )
    parser.add_argument("--timeout", type=float, default=None, help="per-call deadline in seconds")
    parser.add_argument("--retries", type=int, default=3, help="retries on UNAVAILABLE (default 3)")
    parser.add_argument(
        "--tls", action="store_true", help="connect over TLS (the system's roots unless --tls-ca)"
    )
    parser.add_argument("--tls-ca", metavar="PEM", help="CA certificate to trust (implies --tls)")
    parser.add_argument(
        "--tls-cert", metavar="PEM", help="client certificate, for mutual TLS (with --tls-key)"
    )
    parser.add_argument("--tls-key", metavar="PEM", help="client private key, for mutual TLS")
    parser.add_argument(
        "--api-key", default=None, help=f"API key sent as 'authorization: Bearer …' (default: ${API_KEY_ENV})"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    generate = commands.add_parser(
        "generate",
        help="answer a prompt (sent as one user turn through the model's chat template; --raw: plain text)",
    )
    generate.add_argument("prompt", metavar="PROMPT", help="the prompt; '-' reads it from stdin")
    generate.add_argument(
        "--raw",
        action="store_true",
        help="send the prompt as plain text for the model to continue, without the chat template",
    )
    _add_sampling_flags(generate)

    chat = commands.add_parser("chat", help="answer one user message with the chat template")
    chat.add_argument("message", metavar="MESSAGE", help="the user message; '-' reads it from stdin")
    chat.add_argument("--system", metavar="TEXT", help="a system message to put first")
    _add_sampling_flags(chat)

    tokenize = commands.add_parser("tokenize", help="print the token ids of a text")
    tokenize.add_argument("text", metavar="TEXT")
    tokenize.add_argument("--model", default="")
    tokenize.add_argument("--add-special-tokens", action="store_true")
    tokenize.add_argument("--json", action="store_true")

    models = commands.add_parser("models", help="list the served models")
    models.add_argument("--json", action="store_true")

    health = commands.add_parser("health", help="print the server's health status")
    health.add_argument("--service", default="", help="service name ('' = the whole server)")
    health.add_argument("--wait", type=float, metavar="SECONDS", help="wait up to SECONDS for SERVING")
    return parser


def _sampling_options(args: argparse.Namespace) -> GenerateOptions:
    return {
        "model": args.model,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "seed": args.seed,
        "stop": args.stop,
        "stop_token_ids": args.stop_token_ids,
        "ignore_eos": args.ignore_eos,
        "logprobs": args.logprobs,
        "priority": args.priority,
        "deadline_ms": args.deadline_ms,
    }


def _read_arg(value: str) -> str:
    return sys.stdin.read() if value == "-" else value


def _print_completion(completion: Completion, as_json: bool, out: TextIO) -> None:
    if as_json:
        print(json.dumps(dataclasses.asdict(completion)), file=out)
    else:
        print(completion.text, file=out)


def _print_stream(chunks: Iterator[CompletionChunk], as_json: bool, out: TextIO) -> None:
    for chunk in chunks:
        if as_json:
            out.write(json.dumps(dataclasses.asdict(chunk)) + "\n")
        else:
            out.write(chunk.text)
        out.flush()
    if not as_json:
        out.write("\n")
        out.flush()


def _run(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    if args.command in ("generate", "chat"):
        options = _sampling_options(args)
        if args.command == "generate" and args.raw:
            prompt = _read_arg(args.prompt)
            if args.stream:
                _print_stream(client.stream(prompt, timeout=args.timeout, **options), args.json, out)
            else:
                _print_completion(client.generate(prompt, timeout=args.timeout, **options), args.json, out)
            return 0
        # An instruct model answers a bare prompt best as a user turn of its chat template.
        system = getattr(args, "system", None)
        messages = [Message("system", system)] if system else []
        messages.append(
            Message("user", _read_arg(args.prompt if args.command == "generate" else args.message))
        )
        if args.stream:
            _print_stream(client.chat(messages, stream=True, timeout=args.timeout, **options), args.json, out)
        else:
            _print_completion(client.chat(messages, timeout=args.timeout, **options), args.json, out)
        return 0
    if args.command == "tokenize":
        ids = client.tokenize(
            args.text, model=args.model, add_special_tokens=args.add_special_tokens, timeout=args.timeout
        )
        print(json.dumps(ids) if args.json else " ".join(map(str, ids)), file=out)
        return 0
    if args.command == "models":
        models = client.list_models(timeout=args.timeout)
        if args.json:
            print(json.dumps([dataclasses.asdict(m) for m in models]), file=out)
            return 0
        for m in models:
            print(
                f"{m.name}  dtype={m.dtype} backend={m.attention_backend} context={m.context_length} "
                f"block_size={m.block_size} kv_blocks={m.kv_cache_blocks} kv_tokens={m.kv_cache_tokens} "
                f"vocab={m.vocab_size} workers={m.num_workers} kv_cache_dtype={m.kv_cache_dtype or m.dtype}",
                file=out,
            )
        return 0
    assert args.command == "health", f"unhandled command {args.command!r}"
    if args.wait is not None:
        client.wait_until_ready(args.wait, service=args.service)
    status = client.health(args.service, timeout=args.timeout)
    print(status, file=out)
    return 0 if status == "SERVING" else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    args = build_parser().parse_args(argv)
    target = args.target or os.environ.get(TARGET_ENV) or DEFAULT_TARGET
    try:
        secure = args.tls or args.tls_ca or args.tls_cert
        credentials = tls_credentials(args.tls_ca, args.tls_cert, args.tls_key) if secure else None
        api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
        with Client(
            target, timeout=args.timeout, retries=args.retries, credentials=credentials, api_key=api_key
        ) as client:
            return _run(client, args, sys.stdout)
    except DuoserveError as err:
        sys.stdout.flush()
        print(f"error: {err.code.name}: {err.details}", file=sys.stderr)
        return err.exit_status
    except ValueError as err:  # bad client settings, e.g. a negative --retries
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
