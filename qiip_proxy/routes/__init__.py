"""The daemon's HTTP routes, one module per area of the API.

The client API (`_client_api`: `/v1/*`, `/health`; each inference route runs `qiip_proxy._inference`), the chat page
and its coding-agent configs (`_chat_page`, `_client_configs`), and the admin API behind HTTP Basic credentials:
nodes, tokens and endpoints (`_admin`), provisioning (`_provisioning`), the journal and engine logs
(`_journal`), the model catalog (`_models`), deployments and the host pool (`_deployments`). `_log_stream` serves
the kept-then-live logs as server-sent events.
"""
