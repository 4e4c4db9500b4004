"""batches: files, batches and their lines

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 18:00:00

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.String(100), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("filename", sa.String(255), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_files")),
    )
    op.create_index(op.f("ix_files_tenant_id_created_at"), "files", ["tenant_id", "created_at"])
    op.create_table(
        "batches",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.String(100), nullable=False),
        sa.Column("key_id", sa.String(100), nullable=True),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("model", sa.String(200), nullable=True),
        sa.Column("input_file_id", sa.String(64), nullable=False),
        sa.Column("completion_window", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("errors", sa.JSON(), nullable=True),
        sa.Column("output_file_id", sa.String(64), nullable=True),
        sa.Column("error_file_id", sa.String(64), nullable=True),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("expires_at", sa.BigInteger(), nullable=False),
        *(
            sa.Column(name, sa.BigInteger(), nullable=True)
            for name in (
                "in_progress_at",
                "finalizing_at",
                "completed_at",
                "failed_at",
                "expired_at",
                "cancelling_at",
                "cancelled_at",
            )
        ),
        *(
            sa.Column(name, sa.Integer(), nullable=False)
            for name in ("total", "completed", "failed")
        ),
        *(
            sa.Column(name, sa.BigInteger(), nullable=False)
            for name in ("input_tokens", "cached_tokens", "output_tokens", "enqueued_tokens")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_batches")),
    )
    op.create_index(op.f("ix_batches_tenant_id_created_at"), "batches", ["tenant_id", "created_at"])
    op.create_index(op.f("ix_batches_status"), "batches", ["status"])
    op.create_table(
        "batch_lines",
        sa.Column("batch_id", sa.String(64), nullable=False),
        sa.Column("line", sa.Integer(), nullable=False),
        sa.Column("custom_id", sa.String(512), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("tokens", sa.Integer(), nullable=False),
        sa.Column("requests", sa.Integer(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("ok", sa.Boolean(), nullable=True),
        sa.Column("result", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["batch_id"],
            ["batches.id"],
            name=op.f("fk_batch_lines_batch_id_batches"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("batch_id", "line", name=op.f("pk_batch_lines")),
        sa.UniqueConstraint(
            "batch_id", "custom_id", name=op.f("uq_batch_lines_batch_id_custom_id")
        ),
    )


def downgrade() -> None:
    op.drop_table("batch_lines")
    op.drop_index(op.f("ix_batches_status"), table_name="batches")
    op.drop_index(op.f("ix_batches_tenant_id_created_at"), table_name="batches")
    op.drop_table("batches")
    op.drop_index(op.f("ix_files_tenant_id_created_at"), table_name="files")
    op.drop_table("files")
